"""Prepacked linear layers (kernels/cpu_linear.py): the plan made from the CPU's features, the
packed primitive against the exact product, and a model whose projections were packed."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_linear, cpu_paged
from kernels.cpu_linear import CpuFeatures, plan_for

CPU = torch.device("cpu")
AMX = CpuFeatures("Xeon", amx_bf16=True, avx512_bf16=True, avx512=True, avx2=True)
ZEN4 = CpuFeatures("EPYC", amx_bf16=False, avx512_bf16=True, avx512=True, avx2=True)
SKYLAKE = CpuFeatures("Xeon", amx_bf16=False, avx512_bf16=False, avx512=True, avx2=True)
HASWELL = CpuFeatures("Core", amx_bf16=False, avx512_bf16=False, avx512=False, avx2=True)


@pytest.fixture(autouse=True)
def _amx_walk_off(monkeypatch):
    """The plan's decisions, not this machine's: the AMX projection counts as absent unless a
    test says otherwise (``_amx_walk`` reads the extension on the real CPU)."""
    monkeypatch.setattr(cpu_linear, "_amx_walk", lambda: False)


@pytest.mark.unit
@pytest.mark.parametrize(
    "feats,walk,path,words",
    [
        (AMX, True, "amx", "AMX-BF16"),
        (AMX, False, "onednn", "AMX-BF16"),  # tiles on the CPU, but not in this build
        (ZEN4, True, "onednn", "AVX512-BF16"),
        (SKYLAKE, False, "torch", "no bf16 dot products"),
        (HASWELL, False, "torch", "no bf16 dot products"),
    ],
)
def test_the_plan_follows_the_cpus_bf16_units(monkeypatch, feats, walk, path, words):
    monkeypatch.delenv(cpu_linear.PATH_ENV, raising=False)
    monkeypatch.setattr(cpu_linear, "onednn_bf16", lambda: True)  # the decision, not this CPU
    monkeypatch.setattr(cpu_linear, "_amx_walk", lambda: walk)
    plan = plan_for(torch.bfloat16, CPU, features=feats)
    assert plan.path == path and words in plan.reason
    assert plan.packed == (path in ("onednn", "amx"))


@pytest.mark.unit
def test_amx_asked_for_where_it_cannot_run_takes_onednn_and_says_so(monkeypatch):
    monkeypatch.setattr(cpu_linear, "onednn_bf16", lambda: True)
    plan = plan_for(torch.bfloat16, CPU, "amx", features=ZEN4)
    assert plan.path == "onednn" and "PDSERVE_CPU_LINEAR=amx, but no AMX tiles" in plan.reason
    monkeypatch.setattr(cpu_linear, "_amx_walk", lambda: True)
    plan = plan_for(torch.bfloat16, CPU, "amx", features=AMX)
    assert plan.path == "amx" and "PDSERVE_CPU_LINEAR=amx" in plan.reason
    assert plan_for(torch.bfloat16, CPU, "onednn", features=AMX).path == "onednn"
    assert plan_for(torch.float32, CPU, "amx", features=AMX).path == "torch"  # token-exact sgemm


@pytest.mark.unit
def test_fp32_cuda_and_the_override_keep_f_linear(monkeypatch):
    monkeypatch.delenv(cpu_linear.PATH_ENV, raising=False)
    monkeypatch.setattr(cpu_linear, "onednn_bf16", lambda: True)
    # fp32 stays on MKL's sgemm: the tests pin it token for token to transformers
    assert plan_for(torch.float32, CPU, features=AMX).path == "torch"
    assert plan_for(torch.bfloat16, torch.device("cuda"), features=AMX).path == "torch"
    assert plan_for(torch.bfloat16, CPU, "torch", features=AMX).path == "torch"
    monkeypatch.setenv(cpu_linear.PATH_ENV, "torch")
    assert plan_for(torch.bfloat16, CPU, features=AMX).path == "torch"
    monkeypatch.setenv(cpu_linear.PATH_ENV, "onednn")  # forced, even without bf16 units
    assert plan_for(torch.bfloat16, CPU, features=HASWELL).path == "onednn"
    monkeypatch.setenv(cpu_linear.PATH_ENV, "mkl")
    with pytest.raises(ValueError, match="PDSERVE_CPU_LINEAR='mkl'"):
        plan_for(torch.bfloat16, CPU, features=AMX)


@pytest.mark.unit
def test_no_onednn_bf16_keeps_f_linear_even_when_forced(monkeypatch):
    monkeypatch.setattr(cpu_linear, "onednn_bf16", lambda: False)
    monkeypatch.setattr(cpu_paged, "avx2_linear_available", lambda: False)
    for requested in ("auto", "onednn", "avx2"):
        plan = plan_for(torch.bfloat16, CPU, requested, features=AMX)
        assert plan.path == "torch" and not plan.packed
    assert "oneDNN has no bf16" in plan_for(torch.bfloat16, CPU, "auto", features=AMX).reason
    assert "kernel is not built" in plan_for(torch.bfloat16, CPU, "avx2", features=AMX).reason


@pytest.mark.unit
def test_without_onednn_bf16_the_avx2_kernel_takes_bf16(monkeypatch):
    """A CPU whose oneDNN has no bf16 (AVX2 only: Zen 2/3, Haswell to Cascade Lake) runs bf16
    projections in the AVX2 + FMA kernel where it was built, unpacked; ``torch`` and
    ``onednn`` still keep ``F.linear``; ``avx2`` asks for it anywhere it runs."""
    monkeypatch.delenv(cpu_linear.PATH_ENV, raising=False)
    monkeypatch.setattr(cpu_linear, "onednn_bf16", lambda: False)
    monkeypatch.setattr(cpu_paged, "avx2_linear_available", lambda: True)
    plan = plan_for(torch.bfloat16, CPU, features=HASWELL)
    assert plan.path == "avx2" and not plan.packed and "no bf16 dot products" in plan.reason
    assert plan_for(torch.bfloat16, CPU, "torch", features=HASWELL).path == "torch"
    assert plan_for(torch.bfloat16, CPU, "onednn", features=HASWELL).path == "torch"
    assert plan_for(torch.float32, CPU, features=HASWELL).path == "torch"  # token-exact sgemm
    no_avx2 = CpuFeatures("Atom", amx_bf16=False, avx512_bf16=False, avx512=False, avx2=False)
    assert plan_for(torch.bfloat16, CPU, features=no_avx2).path == "torch"
    monkeypatch.setattr(cpu_linear, "onednn_bf16", lambda: True)
    forced = plan_for(torch.bfloat16, CPU, "avx2", features=AMX)
    assert forced.path == "avx2" and "PDSERVE_CPU_LINEAR=avx2" in forced.reason
    assert plan_for(torch.bfloat16, CPU, features=AMX).path == "onednn"  # auto: unchanged


@pytest.mark.unit
@pytest.mark.parametrize(
    ("env", "bad", "good"),
    [
        (
            cpu_linear.BLOCKED_ROWS_ENV,
            ["abc", "0", "-1", "1.5", "16 rows", "\u0661\u0666"],
            ["1", "16"],
        ),
        (cpu_linear.PREFETCH_ROWS_ENV, ["abc", "-1", "1.5", "8 rows", "\u0668"], ["0", "8"]),
        (cpu_linear.WHOLE_K_BYTES_ENV, ["abc", "-1", "4MB", "1e6"], ["0", "4194304"]),
    ],
)
def test_a_bad_avx2_kernel_setting_is_refused_where_the_avx2_plan_is_made(
    monkeypatch, env, bad, good
):
    """The C++ kernel reads PDSERVE_AVX2_BLOCKED_ROWS / PDSERVE_AVX2_PREFETCH_ROWS /
    PDSERVE_AVX2_WHOLE_K_BYTES with atoll:
    "abc" would be 0 (every call blocked; no prefetch) without a word; the plan refuses it,
    so the worker stops at start-up."""
    monkeypatch.delenv(cpu_linear.PATH_ENV, raising=False)
    monkeypatch.setattr(cpu_linear, "onednn_bf16", lambda: False)
    monkeypatch.setattr(cpu_paged, "avx2_linear_available", lambda: True)
    for raw in bad:
        monkeypatch.setenv(env, raw)
        with pytest.raises(ValueError, match=env):
            plan_for(torch.bfloat16, CPU, features=HASWELL)
    for ok in (*good, " 64 ", "1000000000", ""):
        monkeypatch.setenv(env, ok)
        assert plan_for(torch.bfloat16, CPU, features=HASWELL).path == "avx2"
    # another plan never reads it
    monkeypatch.setenv(env, bad[0])
    monkeypatch.setattr(cpu_linear, "onednn_bf16", lambda: True)
    assert plan_for(torch.bfloat16, CPU, features=AMX).path == "onednn"


@pytest.mark.unit
def test_this_cpu_without_onednn_bf16_plans_the_avx2_kernel(monkeypatch):
    monkeypatch.delenv(cpu_linear.PATH_ENV, raising=False)
    if cpu_linear.onednn_bf16() or not cpu_paged.avx2_linear_available():
        pytest.skip("this CPU's oneDNN has bf16, or the AVX2 kernel is not built here")
    assert plan_for(torch.bfloat16, CPU).path == "avx2"


@pytest.mark.unit
def test_detect_reads_this_cpu():
    f = CpuFeatures.detect()
    assert f.avx512_bf16 == torch.cpu._is_avx512_bf16_supported()
    assert f.name and f.name in f.describe()


@pytest.mark.parametrize("m", [1, 3, 16, 64, 300])
@pytest.mark.parametrize("n,k,bias", [(32000, 256, False), (768, 256, True), (256, 688, False)])
def test_packed_linear_is_the_product_within_bf16_rounding(m, n, k, bias):
    """fp32 accumulation and one bf16 rounding, like torch's bf16 matmul: every output within
    half a bf16 ulp (plus summation-order noise) of the exact product."""
    if not cpu_linear.onednn_bf16():
        pytest.skip("no oneDNN bf16 on this CPU")
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    packed = cpu_linear.pack(w)
    assert packed.is_mkldnn and packed.shape == w.shape
    got = cpu_linear.packed_linear(x, packed, b)
    exact = x.float() @ w.float().T + (b.float() if bias else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    bound = exact.abs() * 2.0**-8 + 2e-3 * exact.abs().max()
    assert ((got.float() - exact).abs() <= bound).all()
    ref = torch.nn.functional.linear(x, w, b).float()
    assert (got.float() - exact).abs().max() <= 1.5 * (ref - exact).abs().max() + 1e-6


def _one_prefill(cfg, n: int):
    """(ids, an empty bf16 KV pool, metadata) for one sequence's ``n``-token prefill in 4
    blocks of 16: the inputs both model tests compare two loads of a model on."""
    from shared.models.llama import AttentionMetadata

    shape = (4, cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim)
    kv = torch.zeros(shape, dtype=torch.bfloat16)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        block_tables=torch.arange(4, dtype=torch.int32).unsqueeze(0),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        decode_only=False,
    )
    ids = torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    return ids, kv, meta


def _assert_logits_agree(cfg, plain, other, n: int = 40) -> None:
    """The logits of one ``n``-token prefill through ``other`` are ``plain``'s (F.linear's)
    within bf16 rounding: the same argmax at 95 % of the positions, every logit within 5 % of
    the largest."""
    ids, kv, meta = _one_prefill(cfg, n)
    with torch.inference_mode():
        a = plain.compute_logits(plain(ids, torch.arange(n), kv.clone(), meta)).float()
        b = other.compute_logits(other(ids, torch.arange(n), kv.clone(), meta)).float()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95
    assert (a - b).abs().max() <= 0.05 * a.abs().max()


@pytest.mark.parametrize("head", ["onednn", "amx", "avx512"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases, tied LM head
def test_a_packed_model_drops_its_plain_weights_and_computes_the_same(
    monkeypatch, make_model, arch, head
):
    from kernels import cpu_paged, get_backend
    from shared.config import EngineArgs
    from shared.models.llama import Linear
    from shared.models.loader import load_model
    from shared.models.quantization import weight_bytes

    if not cpu_linear.onednn_bf16():
        pytest.skip("no oneDNN bf16 on this CPU")
    if head == "amx" and not cpu_paged.amx_linear_available():
        pytest.skip("no AMX tiles here")
    if head == "avx512" and not cpu_paged.dp_linear_available():
        pytest.skip("no AVX512-BF16 here")
    cfg = EngineArgs(model=str(make_model("tiny", arch)), dtype="bfloat16").create_model_config()
    backend = get_backend("torch")
    monkeypatch.setenv(cpu_linear.PATH_ENV, "torch")
    plain = load_model(cfg, "cpu", backend)
    monkeypatch.setenv(cpu_linear.PATH_ENV, "onednn")
    monkeypatch.setenv(cpu_linear.HEAD_ENV, head)
    packed = load_model(cfg, "cpu", backend)
    plain_linears = [m for m in plain.modules() if isinstance(m, Linear)]
    linears = [m for m in packed.modules() if isinstance(m, Linear)]
    assert all(m.weight is not None and m.packed is None for m in plain_linears)
    tied = arch == "qwen2"
    on_amx = head != "onednn"  # the one-pass projection, on tiles or on dot products
    assert (packed.head_packed is not None) == on_amx
    assert packed.head_tiles == (head == "amx")
    if on_amx and not tied:  # the head's plain weight went into the tile layout
        assert packed.lm_head.weight is None and packed.lm_head.packed is None
        linears.remove(packed.lm_head)
    assert linears and all(m.weight is None and m.packed is not None for m in linears)
    assert (packed.lm_head is None) == tied
    assert (packed.tied_packed is not None) == (tied and not on_amx)
    assert packed.embed_tokens.weight is not None  # the lookup's table stays
    assert weight_bytes(packed) == weight_bytes(plain)  # the same bytes a step reads

    _assert_logits_agree(cfg, plain, packed)
    if on_amx:  # a greedy step's fused draw is the argmax of the logits the head writes
        n = 40
        ids, kv, meta = _one_prefill(cfg, n)
        with torch.inference_mode():
            h = packed(ids, torch.arange(n), kv.clone(), meta)
            logits = packed.compute_logits(h)
            assert torch.equal(packed.greedy_tokens(h), cpu_paged.argmax_rows(logits))
    else:
        assert packed.greedy_tokens(torch.zeros(1, cfg.hidden_size).bfloat16()) is None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases, tied LM head
def test_an_amx_model_packs_its_projections_into_tiles_and_computes_the_same(
    monkeypatch, make_model, arch
):
    """The ``amx`` plan (the default where the CPU has AMX tiles): every projection whose K is
    a multiple of 32 goes into the tiles' layout, its plain weight dropped, and runs on the AMX
    walk (a bias added after); the logits are F.linear's within bf16 rounding."""
    from kernels import get_backend
    from shared.config import EngineArgs
    from shared.models.llama import Linear
    from shared.models.loader import load_model

    if not cpu_paged.amx_linear_available():
        pytest.skip("no AMX tiles here")
    monkeypatch.setattr(cpu_linear, "_amx_walk", cpu_paged.amx_linear_available)  # this CPU's
    cfg = EngineArgs(model=str(make_model("tiny", arch)), dtype="bfloat16").create_model_config()
    backend = get_backend("torch")
    monkeypatch.setenv(cpu_linear.PATH_ENV, "torch")
    plain = load_model(cfg, "cpu", backend)
    monkeypatch.delenv(cpu_linear.PATH_ENV)
    tiled = load_model(cfg, "cpu", backend)
    layers = [lin for layer in tiled.layers for lin in layer.projections()]
    assert layers and all(type(m) is Linear for m in layers)
    for m in layers:
        k = m.in_features
        assert m.weight is None and m.packed is not None and m.tiles == (k % 32 == 0)
        if m.tiles:
            assert m.tiles_n == m.out_features
            assert m.packed.shape == ((m.out_features + 31) // 32 * 2, k // 32, 512)
    assert any(m.tiles for m in layers)
    assert tiled.head_packed is not None and tiled.head_tiles  # the head's own walk, as before
    _assert_logits_agree(cfg, plain, tiled)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases, tied LM head
def test_an_avx2_model_keeps_its_weights_and_computes_the_same(monkeypatch, make_model, arch):
    """The ``avx2`` plan packs nothing: every projection and the LM head (tied or not) go to
    the AVX2 + FMA kernel on their plain weights, and the logits are F.linear's within bf16
    rounding."""
    from kernels import get_backend
    from shared.config import EngineArgs
    from shared.models.llama import Linear
    from shared.models.loader import load_model

    if not cpu_paged.avx2_linear_available():
        pytest.skip("the AVX2 + FMA kernel is not built on this CPU")
    cfg = EngineArgs(model=str(make_model("tiny", arch)), dtype="bfloat16").create_model_config()
    backend = get_backend("torch")
    monkeypatch.setenv(cpu_linear.PATH_ENV, "torch")
    plain = load_model(cfg, "cpu", backend)
    monkeypatch.setenv(cpu_linear.PATH_ENV, "avx2")
    fast = load_model(cfg, "cpu", backend)
    linears = [m for m in fast.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is None and m.weight is not None for m in linears)
    assert all(m.small is cpu_paged.avx2_linear for m in linears)
    assert fast.small_linear is cpu_paged.avx2_linear  # a tied head's product too
    assert all(
        m.small is not cpu_paged.avx2_linear for m in plain.modules() if isinstance(m, Linear)
    )
    calls = []
    real = cpu_paged.avx2_linear

    def counting(x, w):
        calls.append(x.shape[0])
        return real(x, w)

    for m in linears:
        m.small = counting
    fast.small_linear = counting
    _assert_logits_agree(cfg, plain, fast)
    assert len(calls) == len(linears) + (arch == "qwen2")  # every projection and the head


def test_the_lm_head_setting_is_checked(monkeypatch):
    plan = cpu_linear.LinearPlan("onednn", "test")
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert cpu_linear.head_kernel(plan, w, "onednn") is None
    assert cpu_linear.head_kernel(cpu_linear.LinearPlan("torch", "test"), w, "auto") is None
    odd = torch.zeros(64, 48, dtype=torch.bfloat16)  # K % 32 != 0
    assert cpu_linear.head_kernel(plan, odd, "auto") is None
    with pytest.raises(ValueError, match="PDSERVE_CPU_LM_HEAD='tiles': expected one of auto"):
        cpu_linear.head_kernel(plan, w, "tiles")
    with pytest.raises(ValueError, match="PDSERVE_CPU_LM_HEAD=amx"):
        cpu_linear.head_kernel(plan, odd, "amx")
    with pytest.raises(ValueError, match="PDSERVE_CPU_LM_HEAD=avx512"):
        cpu_linear.head_kernel(plan, odd, "avx512")
    from kernels import cpu_paged

    auto = cpu_linear.head_kernel(plan, w, "auto")  # AMX first, then AVX512-BF16, else oneDNN
    if cpu_paged.amx_linear_available():
        assert auto == "amx"
    elif cpu_paged.dp_linear_available():
        assert auto == "avx512"
    else:
        assert auto is None


def test_a_bad_override_is_a_config_error_naming_it(monkeypatch, make_model):
    """A worker turns ConfigError into one line on stderr and exit 2; a plain ValueError was a
    traceback."""
    from shared.config import ConfigError
    from shared.engine import LLM

    monkeypatch.setenv(cpu_linear.PATH_ENV, "mkl")
    with pytest.raises(ConfigError, match="PDSERVE_CPU_LINEAR='mkl': expected one of auto"):
        LLM(str(make_model("tiny", "llama")), kv_cache_memory="16MiB")
    monkeypatch.delenv(cpu_linear.PATH_ENV)
    monkeypatch.setenv(cpu_linear.HEAD_ENV, "tiles")
    with pytest.raises(ConfigError, match="PDSERVE_CPU_LM_HEAD='tiles': expected one of auto"):
        LLM(str(make_model("tiny", "llama")), kv_cache_memory="16MiB")


def test_a_bad_prefill_tile_setting_fails_the_start(monkeypatch, make_model):
    """``PDSERVE_CPU_PREFILL`` is read when a bf16 model loads, so a bad value (or ``amx`` on
    a CPU without AMX tiles) is a ConfigError at start, not an error at the first prefill."""
    from kernels import cpu_paged
    from shared.config import ConfigError
    from shared.engine import LLM

    if cpu_paged._load() is None:
        pytest.skip("the C++ extension does not build here")
    here = cpu_paged.prefill_paths_here()
    monkeypatch.setattr(cpu_paged, "_prefill_path", None)  # chosen afresh by this load
    monkeypatch.setenv(cpu_paged.PREFILL_ENV, "sse")
    with pytest.raises(ConfigError, match="PDSERVE_CPU_PREFILL='sse': expected one of auto"):
        LLM(str(make_model("tiny", "llama")), kv_cache_memory="16MiB", dtype="bfloat16")
    for setting in ("avx512", "amx", "avx2", "sdpa", "auto"):
        monkeypatch.setattr(cpu_paged, "_prefill_path", None)
        monkeypatch.setenv(cpu_paged.PREFILL_ENV, setting)
        if setting != "auto" and not here[setting]:
            with pytest.raises(ConfigError, match="this CPU or build has no"):
                LLM(str(make_model("tiny", "llama")), kv_cache_memory="16MiB", dtype="bfloat16")
            continue
        LLM(str(make_model("tiny", "llama")), kv_cache_memory="16MiB", dtype="bfloat16")
        best = next(p for p in ("amx", "avx512", "avx2", "sdpa") if here[p])
        assert cpu_paged._prefill_path == (best if setting == "auto" else setting)


def test_only_a_bf16_model_says_which_bf16_attention_kernels_it_runs(
    monkeypatch, make_model, caplog
):
    """An fp32 model's start logged "bf16 decode attention over shared prefixes on ..." (the
    extension's load chose, and logged, the bf16 decode path): a line about kernels the model
    never runs. Now the choice is logged by a bf16 model's load, with the prefill line."""
    import logging

    from kernels import cpu_paged
    from shared.engine import LLM

    if cpu_paged._load() is None:
        pytest.skip("the C++ extension does not build here")
    for name in ("_decode_amx", "_prefill_path"):  # chosen afresh by these loads
        monkeypatch.setattr(cpu_paged, name, None)
    with caplog.at_level(logging.INFO, logger="kernels.cpu_paged"):
        LLM(str(make_model("tiny", "llama")), kv_cache_memory="16MiB")
    assert "bf16" not in caplog.text, caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kernels.cpu_paged"):
        LLM(str(make_model("tiny", "llama")), kv_cache_memory="16MiB", dtype="bfloat16")
    assert "bf16 decode attention over shared prefixes on" in caplog.text, caplog.text
    assert "bf16 prefill attention on" in caplog.text, caplog.text


def test_a_bad_decode_setting_fails_the_start_and_a_good_one_reaches_the_kernel(
    monkeypatch, make_model
):
    """``PDSERVE_CPU_DECODE`` is read when a bf16 model loads: a bad value (or ``amx`` on a
    CPU without AMX tiles) is a ConfigError at start; ``avx512`` / ``auto`` set the kernel's
    shared-group step (``set_decode_amx``), which is what the kernel then runs."""
    from kernels import cpu_paged
    from shared.config import ConfigError
    from shared.engine import LLM

    if cpu_paged._bf16_ext() is None:
        pytest.skip("no AVX512-BF16 build: the C++ decode kernels do not apply")
    ext = cpu_paged._load()
    amx_here = bool(ext.decode_amx_available())
    try:
        monkeypatch.setattr(cpu_paged, "_decode_amx", None)  # chosen afresh by this load
        monkeypatch.setenv(cpu_paged.DECODE_ENV, "sse")
        with pytest.raises(ConfigError, match="PDSERVE_CPU_DECODE='sse': expected one of auto"):
            LLM(str(make_model("tiny", "llama")), kv_cache_memory="16MiB", dtype="bfloat16")
        for setting in ("avx512", "amx", "auto"):
            monkeypatch.setattr(cpu_paged, "_decode_amx", None)
            monkeypatch.setenv(cpu_paged.DECODE_ENV, setting)
            if setting == "amx" and not amx_here:
                with pytest.raises(ConfigError, match="no AMX tiles"):
                    LLM(str(make_model("tiny", "llama")), kv_cache_memory="16MiB", dtype="bfloat16")
                continue
            LLM(str(make_model("tiny", "llama")), kv_cache_memory="16MiB", dtype="bfloat16")
            want = amx_here and setting != "avx512"
            assert cpu_paged._decode_amx is want
            assert ext.decode_amx_on() is want  # what the kernel runs
    finally:
        monkeypatch.setattr(cpu_paged, "_decode_amx", None)
        monkeypatch.delenv(cpu_paged.DECODE_ENV, raising=False)
        cpu_paged.decode_uses_amx()  # back to the default for the tests after this one


@pytest.mark.parametrize("head", ["amx", "avx512"])
def test_greedy_draws_on_the_one_pass_head_match_the_logits_path(monkeypatch, make_model, head):
    """A step whose rows are all plain greedy takes its tokens from the fused head + argmax
    (no logits); the same prompts give the same tokens through oneDNN's logits, and asking
    for logprobs (which needs the logits) does not change them."""
    from kernels import cpu_paged
    from shared.engine import LLM, SamplingParams

    if head == "amx" and not cpu_paged.amx_linear_available():
        pytest.skip("no AMX tiles here")
    if head == "avx512" and not cpu_paged.dp_linear_available():
        pytest.skip("no AVX512-BF16 here")
    model = str(make_model("tiny", "llama"))
    prompts = [[5 + i, 17, 99 + 3 * i, 42] * (1 + i) for i in range(6)]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with_lp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)

    def run(path: str, params: SamplingParams) -> tuple[list[list[int]], int]:
        monkeypatch.setenv(cpu_linear.HEAD_ENV, path)
        llm = LLM(model, kv_cache_memory="16MiB", dtype="bfloat16")
        m = llm.engine.runner.model  # type: ignore[attr-defined]
        calls = []
        fused = m.greedy_tokens
        m.greedy_tokens = lambda h: calls.append(len(h)) or fused(h)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [list(o.outputs[0].token_ids) for o in outs], len(calls)

    one_pass, fused_steps = run(head, greedy)
    assert fused_steps > 0  # the greedy steps drew on the head
    onednn, _ = run("onednn", greedy)
    if head == "amx" or not cpu_paged.amx_linear_available():  # the same bits as oneDNN's kernel
        assert one_pass == onednn
    logprobs, lp_steps = run(head, with_lp)
    assert lp_steps == 0 and logprobs == one_pass
