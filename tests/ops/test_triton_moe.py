"""The Triton fused MoE (and its expert sort) matches the reference on fresh random inputs.

Without CUDA the kernels run in Triton's interpreter on tiny shapes; `gpu` tests use real shapes.
"""

from __future__ import annotations

import json

import pytest
import torch

from moeserve.ops.reference import moe as ref
from moeserve.ops.triton import moe_align as moe_align_module
from moeserve.ops.triton import moe_config
from moeserve.ops.triton.fused_moe import fused_moe
from moeserve.ops.triton.moe_align import moe_align

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def _gemm(bn: int, bk: int, stages: int = 2) -> dict:
    return {"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 2, "num_warps": 4, "num_stages": stages}


def _tma(bn: int, bk: int) -> dict:
    return {**_gemm(bn, bk), "TMA": True}


# Every grouping and tile mode, with tiles that do not divide the tiny test shapes.
CONFIGS = {
    "dense-gemv": {"DENSE": True, "MODE": "gemv", "BLOCK_M": 8, "up": _gemm(16, 32), "down": _gemm(32, 16)},
    "dense-swap": {"DENSE": True, "MODE": "swap", "BLOCK_M": 16, "up": _gemm(16, 32), "down": _gemm(32, 16)},
    "sorted-gemv": {"DENSE": False, "MODE": "gemv", "BLOCK_M": 2, "up": _gemm(16, 32), "down": _gemm(32, 16)},
    "sorted-swap": {"DENSE": False, "MODE": "swap", "BLOCK_M": 16, "up": _gemm(16, 32), "down": _gemm(32, 16)},
    "sorted-dot": {"DENSE": False, "MODE": "dot", "BLOCK_M": 32, "up": _gemm(16, 16), "down": _gemm(32, 32)},
    # Weight tiles through TMA descriptors; up tiles of 16 overrun INTER = 24 into the up rows.
    "dense-swap-tma": {"DENSE": True, "MODE": "swap", "BLOCK_M": 16, "up": _tma(16, 32), "down": _tma(32, 16)},
    "sorted-swap-tma": {"DENSE": False, "MODE": "swap", "BLOCK_M": 16, "up": _tma(16, 32), "down": _gemm(32, 16)},
    "sorted-dot-tma": {"DENSE": False, "MODE": "dot", "BLOCK_M": 32, "up": _tma(16, 16), "down": _tma(32, 32)},
    # Activations in block order, read back as whole tiles by TMA (BLOCK_K 16 does not divide I = 24).
    "sorted-dot-act-tma": {
        "DENSE": False, "MODE": "dot", "BLOCK_M": 32, "ACT_TMA": True, "up": _tma(16, 16), "down": _tma(32, 16),
    },
    # ... and the down GEMM as a few persistent programs, each looping over several tiles.
    "sorted-dot-persistent": {
        "DENSE": False, "MODE": "dot", "BLOCK_M": 16, "ACT_TMA": True, "up": _tma(16, 16),
        "down": {**_tma(16, 16), "PERSISTENT": True},
    },
}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Frobenius-norm relative error, in fp64."""
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty returns NaN / garbage-filled tensors, so elements a kernel skips fail the check."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-123456)

    monkeypatch.setattr(torch, "empty", empty)


@pytest.fixture(params=["one-program", "one-launch", "three-kernels"])
def align_path(request, monkeypatch):
    """Every way moe_align runs: one program, one launch of many, the chunked three-kernel sort.

    Small sub-chunks and offset row blocks make the tiny test shapes take several of each.
    """
    if request.param != "one-program":
        monkeypatch.setattr(moe_align_module, "ONE_PROGRAM_MAX_PAIRS", 0)
        monkeypatch.setattr(moe_align_module, "ONE_LAUNCH_SUB", 16)
    if request.param == "three-kernels":
        monkeypatch.setattr(moe_align_module, "ONE_LAUNCH_MAX_PAIRS", 0)
        monkeypatch.setattr(moe_align_module, "CHUNK", 16)
        monkeypatch.setattr(moe_align_module, "CHUNK_SUB", 8)
        monkeypatch.setattr(moe_align_module, "OFFSET_ROWS", 4)
    return request.param


def routing(tokens: int, experts: int, topk: int, pattern: str, gen: torch.Generator) -> torch.Tensor:
    """[T, k] distinct experts per token under a load pattern."""
    if pattern == "one-expert":  # every token's first choice is expert 1: one long run
        rest = torch.rand(tokens, experts - 1, generator=gen).argsort(dim=1)[:, : topk - 1]
        return torch.cat([torch.ones(tokens, 1, dtype=torch.long), rest + (rest >= 1)], dim=1)
    if pattern == "all-experts":  # rotate so every expert is hit
        base = torch.arange(tokens)[:, None] * topk + torch.arange(topk)[None, :]
        return base % experts
    return torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices


def make_case(tokens, experts, hidden, inter, topk, dtype, pattern, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    # Weights are drawn where they live, in their dtype: V3-sized experts are 11 GB in bf16, and
    # an fp32 host copy per parallel test worker would exhaust the host's memory.
    wgen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=wgen, device=device, dtype=dtype)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=wgen, device=device, dtype=dtype).mul_(hidden**-0.5)
    w2 = torch.randn(experts, hidden, inter, generator=wgen, device=device, dtype=dtype).mul_(inter**-0.5)
    weights = torch.rand(tokens, topk, generator=gen)
    ids = routing(tokens, experts, topk, pattern, gen)
    return x, w13, w2, weights.to(device), ids.to(device)


def check_align(ids: torch.Tensor, experts: int, block_m: int) -> None:
    sorted_ids, block_expert, num_padded = moe_align(ids, experts, block_m)
    flat, n = ids.reshape(-1).long().cpu(), ids.numel()
    sorted_ids, block_expert, padded = sorted_ids.cpu(), block_expert.cpu(), int(num_padded)
    counts = torch.bincount(flat, minlength=experts)
    assert padded == int(((counts + block_m - 1) // block_m * block_m).sum())
    blocks = sorted_ids.view(-1, block_m)
    used = padded // block_m
    assert (block_expert[used:] == -1).all()
    real = blocks[:used][blocks[:used] < n]
    assert sorted(real.tolist()) == list(range(n))
    for b in range(used):
        rows = blocks[b][blocks[b] < n].long()
        assert (flat[rows] == block_expert[b]).all()
        assert (blocks[b][blocks[b] >= n] == n).all()
        assert torch.equal(rows, rows.sort().values), "stable: token order inside an expert"


@pytest.mark.parametrize(
    ("tokens", "topk", "experts", "block_m"),
    [(1, 2, 4, 1), (5, 2, 4, 16), (33, 6, 64, 16), (90, 8, 256, 64), (10, 3, 7, 4)],
)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_moe_align_sorts_every_pair_once(tokens, topk, experts, block_m, ids_dtype, align_path, poisoned):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices
    check_align(ids.to(device=DEVICE, dtype=ids_dtype), experts, block_m)


def test_moe_align_one_expert_takes_all(align_path, poisoned):
    check_align(torch.full((40, 1), 3, dtype=torch.int32, device=DEVICE), 8, 16)


def test_moe_align_drops_ids_out_of_range(align_path, poisoned):
    ids = torch.tensor([[2, 9], [-1, 2], [0, 8], [5, 0]], dtype=torch.int32, device=DEVICE)
    sorted_ids, block_expert, num_padded = moe_align(ids, 8, 4)
    assert int(num_padded) == 12  # experts 0, 2 and 5, one block of 4 each
    assert block_expert.cpu()[:3].tolist() == [0, 2, 5]
    assert sorted_ids.cpu()[:12].tolist() == [4, 7, 8, 8, 0, 3, 8, 8, 6, 8, 8, 8]


@pytest.mark.parametrize(
    ("name", "tokens", "pattern", "ids_dtype"),
    [
        ("dense-gemv", 5, "random", torch.int64),
        ("dense-swap", 11, "one-expert", torch.int32),
        ("sorted-gemv", 5, "all-experts", torch.int32),
        ("sorted-swap", 13, "one-expert", torch.int64),
        ("sorted-swap", 3, "random", torch.int32),
        ("sorted-dot", 21, "random", torch.int32),
        ("sorted-dot", 19, "all-experts", torch.int64),
        ("dense-swap-tma", 7, "random", torch.int32),
        ("sorted-swap-tma", 13, "one-expert", torch.int64),
        ("sorted-dot-tma", 21, "all-experts", torch.int32),
        ("sorted-dot-act-tma", 21, "random", torch.int32),
        ("sorted-dot-act-tma", 40, "one-expert", torch.int64),
        ("sorted-dot-persistent", 21, "random", torch.int32),
        ("sorted-dot-persistent", 40, "one-expert", torch.int64),
    ],
)
def test_fused_moe_matches_reference_fp32(name, tokens, pattern, ids_dtype, poisoned):
    x, w13, w2, weights, ids = make_case(tokens, 6, 40, 24, 3, torch.float32, pattern, seed=tokens)
    ids = ids.to(ids_dtype)
    want = ref.fused_moe(x, w13, w2, weights, ids)
    got = fused_moe(x, w13, w2, weights, ids, config=CONFIGS[name])
    assert got.dtype == x.dtype and got.shape == x.shape
    assert rel_err(got, want) < 3e-5


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 3e-3), (torch.bfloat16, 3e-2)])
def test_fused_moe_half_precision_default_config(dtype, tol, poisoned):
    # bf16 is loose here only because the interpreter truncates fp32 -> bf16; GPU tests use 1e-2.
    x, w13, w2, weights, ids = make_case(6, 8, 32, 48, 2, dtype, "random", seed=3)
    want = ref.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    got = fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == dtype
    assert rel_err(got, want) < tol


@pytest.mark.parametrize("name", ["dense-gemv", "sorted-swap"])
def test_fused_moe_unsummed_parts_match_reference(name, poisoned):
    """sum_slots=False: each (token, slot)'s weighted expert output, [T, k, H], summing to the result."""
    x, w13, w2, weights, ids = make_case(5, 6, 40, 24, 3, torch.float32, "random", seed=9)
    got = fused_moe(x, w13, w2, weights, ids, sum_slots=False, config=CONFIGS[name])
    want = ref.fused_moe(x, w13, w2, weights, ids, sum_slots=False)
    assert got.shape == want.shape == (5, 3, 40)
    assert rel_err(got, want) < 3e-5
    assert rel_err(got.sum(1), ref.fused_moe(x, w13, w2, weights, ids)) < 3e-5
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0], sum_slots=False).shape == (0, 3, 40)


def test_tma_config_falls_back_on_weights_tma_cannot_read(poisoned):
    """Experts not packed back to back (a slice of wider rows): the TMA config runs on pointer loads."""
    x, w13, w2, weights, ids = make_case(13, 6, 40, 24, 3, torch.float32, "random", seed=4)
    wide = torch.zeros(6, 2 * 24 + 8, 40, device=DEVICE)
    wide[:, : 2 * 24] = w13
    unpacked = wide[:, : 2 * 24]
    assert unpacked.stride(0) != unpacked.shape[1] * unpacked.stride(1)
    got = fused_moe(x, unpacked, w2, weights, ids, config=CONFIGS["sorted-dot-tma"])
    assert rel_err(got, ref.fused_moe(x, w13, w2, weights, ids)) < 3e-5
    # Down weights TMA cannot read, activations in block order: read back by pointer.
    tall = torch.zeros(6, 40 + 8, 24, device=DEVICE)
    tall[:, :40] = w2
    assert tall[:, :40].stride(0) != 40 * 24
    got = fused_moe(x, w13, tall[:, :40], weights, ids, config=CONFIGS["sorted-dot-act-tma"])
    assert rel_err(got, ref.fused_moe(x, w13, w2, weights, ids)) < 3e-5


def test_fused_moe_top1_and_empty_batch():
    x, w13, w2, weights, ids = make_case(4, 3, 16, 16, 1, torch.float32, "random", seed=1)
    want = ref.fused_moe(x, w13, w2, weights, ids)
    assert rel_err(fused_moe(x, w13, w2, weights, ids, config=CONFIGS["sorted-swap"]), want) < 3e-5
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 16)


def test_fused_moe_rejects_bad_shapes():
    x, w13, w2, weights, ids = make_case(2, 3, 16, 16, 1, torch.float32, "random", seed=1)
    with pytest.raises(ValueError, match="shapes disagree"):
        fused_moe(x, w13, w2[:, :8], weights, ids)
    with pytest.raises(ValueError, match="int32 or int64"):
        fused_moe(x, w13, w2, weights, ids.float())
    with pytest.raises(ValueError, match="dense path"):
        fused_moe(x.repeat(5, 1), w13, w2, weights.repeat(5, 1), ids.repeat(5, 1), config=CONFIGS["dense-gemv"])


def test_config_buckets_defaults_and_files(tmp_path, monkeypatch):
    default = moe_config.default_config(1, 64, 6)
    assert default["DENSE"] and moe_config.validate_config(default, 1) is None
    for tokens in (1, 9, 64, 300, 5000):
        assert moe_config.validate_config(moe_config.default_config(tokens, 64, 6), tokens) is None
    tuned = {"_meta": {}, "8": CONFIGS["dense-gemv"], "64": CONFIGS["sorted-dot"]}
    name = moe_config.config_file_name(8, 24, 40, "cpu", torch.float32)
    (tmp_path / name).write_text(json.dumps(tuned))
    monkeypatch.setenv(moe_config.CONFIG_DIR_ENV, str(tmp_path))
    moe_config.load_configs.cache_clear()
    configs = moe_config.load_configs(8, 24, 40, "cpu", torch.float32)
    assert set(configs) == {8, 64}
    assert moe_config.pick_config(configs, 5, 8, 2) == CONFIGS["dense-gemv"]
    # 12 tokens are nearest bucket 8, whose dense BLOCK_M of 8 cannot hold them: next bucket.
    assert moe_config.pick_config(configs, 12, 8, 2) == CONFIGS["sorted-dot"]
    moe_config.load_configs.cache_clear()


def test_a_gpu_without_its_own_file_takes_one_of_its_architecture(tmp_path, monkeypatch):
    def write(device: str, capability: list[int], config: dict) -> None:
        tuned = {"_meta": {"device": device, "capability": capability}, "64": config}
        (tmp_path / moe_config.config_file_name(8, 24, 40, device, torch.bfloat16)).write_text(json.dumps(tuned))

    write("GPU_A", [9, 0], CONFIGS["sorted-dot"])
    write("GPU_B", [8, 0], CONFIGS["dense-gemv"])
    monkeypatch.setenv(moe_config.CONFIG_DIR_ENV, str(tmp_path))
    moe_config.load_configs.cache_clear()
    try:
        assert moe_config.load_configs(8, 24, 40, "GPU_A", torch.bfloat16) == {64: CONFIGS["sorted-dot"]}
        assert moe_config.load_configs(8, 24, 40, "GPU_C", torch.bfloat16, (9, 0)) == {64: CONFIGS["sorted-dot"]}
        assert moe_config.load_configs(8, 24, 40, "GPU_C", torch.bfloat16, (8, 0)) == {64: CONFIGS["dense-gemv"]}
        assert moe_config.load_configs(8, 24, 40, "GPU_C", torch.bfloat16, (10, 0)) is None
        assert moe_config.load_configs(8, 24, 40, "GPU_C", torch.bfloat16) is None  # no capability: no guess
        assert moe_config.load_configs(8, 24, 40, "GPU_C", torch.float16, (9, 0)) is None  # another dtype's file
    finally:
        moe_config.load_configs.cache_clear()


def test_every_shipped_file_names_its_gpu_and_architecture():
    for path in moe_config.CONFIG_DIR.glob("*.json"):
        meta = json.loads(path.read_text())["_meta"]
        assert f"device={meta['device']}," in path.name and len(meta["capability"]) == 2, path.name


def test_tuner_writes_a_loadable_file(tmp_path):
    from moeserve.ops.triton import tune_moe

    path = tune_moe.main(["--experts", "4", "--hidden", "32", "--inter", "16", "--topk", "2", "--batch-sizes", "1",
                          "--iters", "1", "--quick", "--max-candidates", "1", "--output", str(tmp_path),
                          "--device", DEVICE])
    configs = {int(k): v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    assert moe_config.validate_config(configs[1], 1) is None


def test_tuner_tries_block_order_activations_only_where_tma_and_dot_tiles_allow():
    from moeserve.ops.triton import tune_moe

    plain = tune_moe.candidate_groupings(16384, 64, 6, quick=False)
    hopper = tune_moe.candidate_groupings(16384, 64, 6, quick=False, tma=True)
    assert not any(g.get("ACT_TMA") for g in plain)
    extra = [g for g in hopper if g.get("ACT_TMA")]
    assert extra and all(g["MODE"] == "dot" and g["BLOCK_M"] >= 64 and not g["DENSE"] for g in extra)
    assert not any(g.get("ACT_TMA") for g in tune_moe.candidate_groupings(4, 64, 6, quick=False, tma=True))


def test_tuner_with_shared_experts_names_the_stacked_count(tmp_path):
    from moeserve.ops.triton import tune_moe

    path = tune_moe.main(["--experts", "4", "--shared", "2", "--hidden", "32", "--inter", "16", "--topk", "2",
                          "--batch-sizes", "3", "--iters", "1", "--quick", "--max-candidates", "1",
                          "--output", str(tmp_path), "--device", DEVICE])
    assert path.name.startswith("E=6,")
    raw = json.loads(path.read_text())
    assert raw["_meta"]["shared"] == 2 and moe_config.validate_config(raw["3"], 3) is None
    weights = tune_moe.make_weights(6, 32, 16, torch.float32, DEVICE)
    ids = tune_moe.make_inputs(3, weights, 2, shared=2)["ids"]
    # Routed picks are distinct and below the shared ones; every token ends with experts 4 and 5.
    assert ids.shape == (3, 4) and bool((ids[:, :2] < 4).all()) and ids[:, 2:].tolist() == [[4, 5]] * 3
    assert all(len(set(row)) == 4 for row in ids.tolist())


V2_LITE = (64, 2048, 1408, 6)
V3_LIKE = (256, 7168, 2048, 8)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("tokens", "topk", "experts", "block_m"),
    # One program, one launch (decode at 256 with the shared experts fused; the largest size it
    # takes), then the three kernels at a 16K-token prompt step and at a V3-sized 64K-token one
    # (2,048 chunks, 256 experts).
    [(64, 8, 66, 16), (256, 8, 66, 64), (1365, 6, 64, 128), (16384, 6, 64, 128), (65536, 8, 256, 128)],
)
def test_gpu_moe_align_real_sizes(tokens, topk, experts, block_m, poisoned):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices
    check_align(ids.to(device=DEVICE, dtype=torch.int32), experts, block_m)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 256, 1024])
@pytest.mark.parametrize("shape", [V2_LITE, V3_LIKE], ids=["v2-lite", "v3"])
def test_gpu_fused_moe_real_shapes(shape, tokens, poisoned):
    experts, hidden, inter, topk = shape
    x, w13, w2, weights, ids = make_case(tokens, experts, hidden, inter, topk, torch.bfloat16, "random", tokens)
    assert rel_err(fused_moe(x, w13, w2, weights, ids), ref.fused_moe(x, w13, w2, weights, ids)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("pattern", ["random", "one-expert", "all-experts"])
def test_gpu_every_mode_and_load(name, pattern, poisoned):
    # The dense paths take at most BLOCK_M tokens (fused_moe refuses more when a config is forced).
    tokens = min(13, CONFIGS[name]["BLOCK_M"]) if CONFIGS[name]["DENSE"] else 200
    x, w13, w2, weights, ids = make_case(tokens, 64, 512, 352, 6, torch.bfloat16, pattern, seed=5)
    want = ref.fused_moe(x, w13, w2, weights, ids)
    assert rel_err(fused_moe(x, w13, w2, weights, ids.int(), config=CONFIGS[name]), want) < 1e-2
    x32, w13_32, w2_32 = x.float(), w13.float(), w2.float()
    got = fused_moe(x32, w13_32, w2_32, weights, ids, config=CONFIGS[name])
    assert rel_err(got, ref.fused_moe(x32, w13_32, w2_32, weights, ids)) < 3e-4


def shipped_configs() -> list:
    """(file, bucket, config) of every tuned config shipped for V2-Lite's experts (66 with the shared
    ones fused), whatever the GPU they were tuned on: any Hopper runs them."""
    out = []
    for path in sorted(moe_config.CONFIG_DIR.glob("E=6[46],I=1408,H=2048,*.json")):
        raw = json.loads(path.read_text())
        file, gpu = path.name.split(",")[0], raw["_meta"]["device"]
        out += [pytest.param(file, int(k), v, id=f"{file}-{gpu}-{k}") for k, v in raw.items() if k != "_meta"]
    return out


@pytest.mark.gpu
@pytest.mark.parametrize(("file", "bucket", "config"), shipped_configs())
def test_gpu_every_shipped_config(file, bucket, config, poisoned):
    """Each shipped tile (the paired gate/up TMA box at every BLOCK_N / BLOCK_K the tuner kept among
    them) matches the reference at its bucket's token count (capped: the reference is slow)."""
    experts, topk = (66, 8) if file == "E=66" else (64, 6)
    tokens = min(bucket, 4096)
    x, w13, w2, weights, ids = make_case(tokens, experts, 2048, 1408, topk, torch.bfloat16, "random", bucket)
    got = fused_moe(x, w13, w2, weights, ids, config=config)
    assert rel_err(got, ref.fused_moe(x, w13, w2, weights, ids)) < 1e-2


@pytest.mark.gpu
def test_gpu_fused_moe_is_graph_capturable():
    experts, hidden, inter, topk = V2_LITE
    for tokens in (4, 96):
        x, w13, w2, weights, ids = make_case(tokens, experts, hidden, inter, topk, torch.bfloat16, "random", 0)
        static = [x.clone(), weights.clone(), ids.clone()]
        fused_moe(static[0], w13, w2, static[1], static[2])  # compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_moe(static[0], w13, w2, static[1], static[2])
        for seed in (1, 2):
            x2, _, _, w_new, ids_new = make_case(tokens, experts, hidden, inter, topk, torch.bfloat16, "random", seed)
            for dst, src in zip(static, (x2, w_new, ids_new), strict=True):
                dst.copy_(src)
            graph.replay()
            assert rel_err(out, ref.fused_moe(x2, w13, w2, w_new, ids_new)) < 1e-2


@pytest.mark.gpu
def test_gpu_persistent_down_reads_its_tile_count_on_replay():
    """The persistent down GEMM takes its tile count from the device, so a graph captured on one
    routing is right on another with a different number of used blocks."""
    config = {**CONFIGS["sorted-dot-persistent"], "BLOCK_M": 64}
    config["down"] = {**config["down"], "BLOCK_N": 128, "BLOCK_K": 64}
    x, w13, w2, weights, ids = make_case(300, 64, 512, 352, 6, torch.bfloat16, "random", 0)
    static = [x.clone(), weights.clone(), ids.clone()]
    fused_moe(static[0], w13, w2, static[1], static[2], config=config)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(static[0], w13, w2, static[1], static[2], config=config)
    for seed, pattern in ((1, "one-expert"), (2, "all-experts"), (3, "random")):
        x2, _, _, w_new, ids_new = make_case(300, 64, 512, 352, 6, torch.bfloat16, pattern, seed)
        for dst, src in zip(static, (x2, w_new, ids_new), strict=True):
            dst.copy_(src)
        graph.replay()
        assert rel_err(out, ref.fused_moe(x2, w13, w2, w_new, ids_new)) < 1e-2, pattern


def test_tuner_update_replaces_only_the_sizes_it_tunes(tmp_path):
    from moeserve.ops.triton import tune_moe

    common = ["--experts", "4", "--hidden", "32", "--inter", "16", "--iters", "1", "--quick", "--max-candidates", "1",
              "--output", str(tmp_path), "--device", DEVICE]  # fmt: skip
    path = tune_moe.main([*common, "--topk", "2", "--batch-sizes", "1", "3"])
    first = json.loads(path.read_text())
    first["3"]["up"]["num_stages"] = 9  # a marker the retune must overwrite
    first["1"]["up"]["num_stages"] = 8  # and one it must keep
    path.write_text(json.dumps(first))
    tune_moe.main([*common, "--topk", "2", "--batch-sizes", "3", "--update"])
    merged = json.loads(path.read_text())
    assert merged["1"]["up"]["num_stages"] == 8 and merged["3"]["up"]["num_stages"] != 9
    assert merged["_meta"]["updated"] == [3] and set(merged["_meta"]["timings"]) == {"1", "3"}
    with pytest.raises(ValueError, match="topk"):
        tune_moe.main([*common, "--topk", "1", "--batch-sizes", "3", "--update"])
    assert json.loads(path.read_text()) == merged  # a refused update leaves the file alone


def test_change_points_reach_every_config_the_picker_can_choose():
    """Warm-up runs only these token counts, so together they must cover every pick in the range."""
    args = (64, 1408, 2048, "NVIDIA_H200", torch.bfloat16, 6)
    points = moe_config.config_change_points(*args, 385, 8192)
    configs = moe_config.load_configs(64, 1408, 2048, "NVIDIA_H200", torch.bfloat16)
    assert configs is not None and points[0] == 385

    def pick(t):
        return json.dumps(moe_config.pick_config(configs, t, 64, 6), sort_keys=True)

    warmed = {pick(t) for t in points}
    assert len(warmed) == len(points)  # one count per distinct config
    assert {pick(t) for t in range(385, 8193)} == warmed
    assert pick(8192) != pick(385)  # the file really changes config across the range
