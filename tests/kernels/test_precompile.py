"""The start-up precompile (kernels/precompile.py) on the CPU: a specialisation in Triton's own
specialization_data format, compiled by a spawned worker, lands in the on-disk cache under the key that
``triton.compile`` (what the JIT calls) looks up, also from workers started ahead (WorkerPool); and the dry
shapes reach every kernel path.

Recording real launches needs a GPU (Triton's launcher): tests/gpu and bench/gpu_checks.py cover that part
(after precompile, start-up compiles nothing).
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.jit import serialize_specialization_data

from onecard.kernels import precompile as pc
from onecard.runner.precompile import dry_shapes

TARGET = ("cuda", 90, 32)


def _rms_norm_spec(h: int, has_res: bool, warps: int) -> pc.KernelSpec:
    """What the JIT records for rms_norm(fp16 [T, h]): pointers 16-byte aligned, H and strides % 16 == 0."""
    from onecard.kernels.norm.triton import _rms_norm_kernel as k

    names = k.arg_names
    sig = {n: "*fp16" for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")}
    sig.update(H="i32", eps="fp32", stride_x="i32", stride_r="i32", BLOCK="constexpr", HAS_RES="constexpr")
    constexprs = {(names.index("BLOCK"),): h, (names.index("HAS_RES"),): has_res}
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr", "H", "stride_x", "stride_r")}
    options = make_backend(GPUTarget(*TARGET)).parse_options(dict(num_warps=warps, num_stages=1))
    data = serialize_specialization_data("rms", sig, constexprs, attrs, options, "key")
    return pc.KernelSpec(k.fn.__module__, k.fn.__name__, data)


def test_worker_compile_is_a_cache_hit_for_triton_compile(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    specs = [_rms_norm_spec(2048, True, 4), _rms_norm_spec(1024, False, 4)]
    assert not any(pc.is_cached(s, TARGET) for s in specs)
    summary = pc.compile_all(specs, TARGET, workers=2)
    assert summary["errors"] == [] and summary["compiled"] == 2 and summary["kernels"] == 2
    _assert_jit_cache_hits(specs, monkeypatch)
    # a second start-up finds everything cached and starts no workers
    again = pc.compile_all(specs, TARGET)
    assert again["compiled"] == 0 and again["workers"] == 0


def _assert_jit_cache_hits(specs: list[pc.KernelSpec], monkeypatch) -> None:
    """What the JIT would do at the launch: triton.compile on the same source -> the listener sees a hit."""
    assert all(pc.is_cached(s, TARGET) for s in specs)
    seen = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **kw: seen.append(kw["cache_hit"]))
    for s in specs:
        src, options = pc._source(s)
        k = triton.compile(src, target=GPUTarget(*TARGET), options=options)
        assert k.asm.get("cubin")
    assert seen == [True] * len(specs)


def test_a_pool_started_early_compiles_into_the_cache(tmp_path, monkeypatch):
    """The runner starts the workers before it loads the weights; compile_all then feeds those workers."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))                 # before the pool: workers inherit it
    specs = [_rms_norm_spec(2048, True, 4), _rms_norm_spec(1024, False, 4), _rms_norm_spec(512, True, 2)]
    with pc.WorkerPool(2) as pool:
        assert len(pool) == 2 and all(p.poll() is None for p in pool.procs)   # booting or waiting for jobs
        summary = pc.compile_all(specs, TARGET, pool=pool)
        assert summary["errors"] == [] and summary["compiled"] == 3 and summary["workers"] == 2
        assert all(p.poll() is None for p in pool.procs)                  # the owner closes them, not compile_all
        assert pc.compile_all(specs, TARGET, pool=pool)["compiled"] == 0  # all cached: nothing to do
    assert all(p.poll() is not None for p in pool.procs)                  # exited and reaped
    _assert_jit_cache_hits(specs, monkeypatch)


def test_a_pool_closed_without_jobs_exits_cleanly():
    pool = pc.WorkerPool(2)
    pool.close()
    assert [p.poll() for p in pool.procs] == [0, 0]
    pool.close()                                                          # idempotent


def test_a_dead_pool_worker_is_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    specs = [_rms_norm_spec(2048, True, 4), _rms_norm_spec(1024, False, 4)]
    with pc.WorkerPool(2) as pool:
        pool.procs[0].kill()
        pool.procs[0].wait()
        summary = pc.compile_all(specs, TARGET, pool=pool)
    assert all("the compile worker exited" in e for e in summary["errors"]) and len(summary["errors"]) <= 1
    assert sum(pc.is_cached(s, TARGET) for s in specs) == len(specs) - len(summary["errors"])


def _compile_in_daemon(cache_dir: str, data: str, out) -> None:
    import os

    os.environ["TRITON_CACHE_DIR"] = cache_dir
    spec = pc.KernelSpec("onecard.kernels.norm.triton", "_rms_norm_kernel", data)
    out.put(pc.compile_all([spec], TARGET, workers=1))


def test_compile_all_runs_inside_a_daemon_process(tmp_path):
    """The engine process is a multiprocessing daemon (it may not start multiprocessing children)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_compile_in_daemon, args=(str(tmp_path), _rms_norm_spec(2048, False, 4).data, q),
                    daemon=True)
    p.start()
    summary = q.get(timeout=120)
    p.join(30)
    assert summary["compiled"] == 1 and summary["errors"] == [] and summary["workers"] == 1


def test_a_spec_that_fails_is_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    bad = pc.KernelSpec("onecard.kernels.norm.triton", "no_such_kernel", _rms_norm_spec(2048, True, 4).data)
    summary = pc.compile_all([bad], TARGET, workers=1)
    assert summary["compiled"] == 1 and len(summary["errors"]) == 1 and "no_such_kernel" in summary["errors"][0]


def test_parse_spec_round_trips_triton_serialization():
    s = _rms_norm_spec(2048, True, 8)
    sig, constexprs, attrs, options = pc.parse_spec(s.data)
    assert sig["x_ptr"] == "*fp16" and sig["BLOCK"] == "constexpr"
    assert sorted(constexprs.values(), key=str) == sorted([2048, True], key=str)
    assert all(v == [["tt.divisibility", 16]] for v in attrs.values()) and len(attrs) == 8
    assert options["num_warps"] == 8


@pytest.mark.parametrize("max_seqs,budget,max_len", [(16, 8192, 65536), (4, 512, 2048), (1, 64, 128)])
def test_dry_shapes_reach_every_path(max_seqs, budget, max_len):
    from onecard.kernels.fused_moe.grouped import GROUPED_MIN_TOKENS
    from onecard.kernels.fused_moe.triton import choose_config as moe_config
    from onecard.kernels.gptq_gemm.triton import choose_config as gemm_config

    shapes = dry_shapes(max_seqs, budget, max_len)
    for q, c, _ in shapes:
        assert len(q) == len(c) <= max_seqs
        assert all(qi + ci <= max_len for qi, ci in zip(q, c)) and all(qi >= 1 for qi in q)
        assert sum(q) <= max(budget, max_seqs)                      # within one step's budget
    decode_sizes = {len(q) for q, _, _ in shapes if set(q) == {1}}
    assert decode_sizes == set(range(1, max_seqs + 1))
    tokens = {sum(q) for q, _, _ in shapes}
    cap = min(budget, max_len)
    assert {gemm_config(t) for t in tokens} >= {gemm_config(t) for t in range(1, cap + 1)}
    moe_paths = {moe_config(t) if t < GROUPED_MIN_TOKENS else "grouped" for t in tokens}
    assert moe_paths >= {moe_config(t) if t < GROUPED_MIN_TOKENS else "grouped" for t in range(1, cap + 1)}
    if max_seqs >= 2:
        assert any(q[0] == 1 and q[-1] > 1 for q, _, _ in shapes)          # a mixed decode + prefill step


@pytest.mark.parametrize("max_seqs,budget,max_len", [(16, 8192, 65536), (4, 512, 2048), (1, 64, 128),
                                                     (16, 2048, 4096)])
@pytest.mark.parametrize("cc", [70, 75, 80, 90])
def test_dry_shapes_cover_every_boundary_of_the_path_table(cc, max_seqs, budget, max_len):
    """On each capability, the dry forwards' token counts reach every path of every op that the step budget
    allows, and both sides of every boundary of kernels/paths.py (where a path changes at T: T - 1 and T)."""
    from onecard.kernels import paths

    tokens = {sum(q) for q, _, _ in dry_shapes(max_seqs, budget, max_len)}
    cap = min(budget, max_len)
    for op in paths.OPS:
        every = {t: paths.choose(op, t, cc) for t in range(1, cap + 1)}
        assert {every[t] for t in tokens if t in every} == set(every.values()), (op, cc)
        edges = [t for t in range(2, cap + 1) if every[t] != every[t - 1]]
        assert edges and set(edges) <= set(paths.token_boundaries())
        missing = [(t - 1, t) for t in edges if not {t - 1, t} <= tokens]
        assert not missing, (op, cc, missing)


def test_dry_batches_are_valid_forwards(tiny_moe_gptq_dir):
    """Every dry shape, built by runner/precompile.batch, is a forward the engine can really run (ref backend,
    CPU): the metadata is consistent, so the kernels would see the arguments serving gives them."""
    from onecard.config import EngineArgs
    from onecard.runner.model_runner import ModelRunner
    from onecard.runner.precompile import batch

    cfg = EngineArgs(model=str(tiny_moe_gptq_dir), device="cpu", max_model_len=512, max_num_seqs=4,
                     max_num_batched_tokens=300).create_config()
    runner = ModelRunner(cfg)
    runner.initialize_kv_cache(2, log=False)
    assert runner.compile_pool is None                                   # CPU: no compile workers started
    assert runner.precompile() is None                                   # CPU: nothing to compile
    for q, c, long in dry_shapes(4, 300, 512):
        ids, pos, md = batch(q, c, runner.block_size, runner.device, max_seq_len=512 if long else None)
        assert md.query_start_loc[-1].item() == ids.numel() == pos.numel() == sum(q)
        assert md.seq_lens.tolist() == [a + b for a, b in zip(q, c)] and md.max_query_len == max(q)
        assert md.num_decode_tokens == next((i for i, n in enumerate(q) if n != 1), len(q))
        out = runner.model(ids, pos, runner.kv_caches, md)
        assert out.shape[0] == sum(q) and torch.isfinite(out).all()


def test_dry_run_runs_one_layer_of_each_kind_and_leaves_the_model_whole(tiny_moe_gptq_dir):
    """The precompile's dry run (runner/precompile.dry_run) goes through the model's public forward with
    ``layer_ids``: on the CPU its forwards really run, through the representative layers only (each twice: as
    the first layer and after one), and the model keeps
    every layer; a forward over all layer ids is the plain forward, bit for bit."""
    from onecard.config import EngineArgs
    from onecard.runner.model_runner import ModelRunner
    from onecard.runner.precompile import batch, dry_run, representative_layers

    cfg = EngineArgs(model=str(tiny_moe_gptq_dir), device="cpu", max_model_len=256, max_num_seqs=3,
                     max_num_batched_tokens=130).create_config()
    runner = ModelRunner(cfg)
    runner.initialize_kv_cache(-(-130 // runner.block_size) + 3, log=False)   # the profile's forward writes KV
    model = runner.model
    layers = list(model.layers)
    reps = representative_layers(model.layers)
    assert reps == [0] and len(layers) >= 2
    calls = [0] * len(layers)
    hooks = [layer.register_forward_hook(lambda *_a, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, layer in enumerate(layers)]
    try:
        dry_run(runner)
    finally:
        for h in hooks:
            h.remove()
    # the profile once, every recorded forward twice (each kind as the first layer and after one)
    forwards = 1 + 2 * (len(runner.graph_batch_sizes()) + len(dry_shapes(3, 130, 256)))
    assert calls == [forwards] + [0] * (len(layers) - 1)
    assert list(model.layers) == layers
    _, pos, md = batch([1, 5], [3, 0], runner.block_size, runner.device)
    ids = torch.arange(100, 106)                      # real ids: the dry batches' zeros give an all-zero output here
    with torch.inference_mode():
        plain = model(ids, pos, runner.kv_caches, md)
        every = model(ids, pos, runner.kv_caches, md, list(range(len(layers))))
        first = model(ids, pos, runner.kv_caches, md, [0])
    assert torch.equal(plain, every) and not torch.equal(plain, first)


def test_representative_layers(tiny_moe_gptq_dir, tiny_dense_dir):
    """One layer per distinct kind: identical layers collapse; a layer with other shapes is its own kind."""
    import copy

    from onecard.config import EngineArgs
    from onecard.models.loader import load_model
    from onecard.runner.precompile import representative_layers

    for d in (tiny_moe_gptq_dir, tiny_dense_dir):
        cfg = EngineArgs(model=str(d), device="cpu").create_config()
        model = load_model(cfg.model, torch.device("cpu"), torch.float32)
        n = len(model.layers)
        assert n >= 2 and representative_layers(model.layers) == [0]
        odd = copy.deepcopy(model.layers[1])
        odd.input_layernorm = odd.input_layernorm[:-1].clone()             # a different shape: another kind
        model.layers[1] = odd
        assert representative_layers(model.layers) == [0, 1]
