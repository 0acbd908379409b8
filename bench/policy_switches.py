"""The "+NAME" switches of a benchmark policy spec ("fill+slices_st3+no_b1_acc"): kernels/paths.py's on/off switches
and config-table or module-constant overrides, by short name (``switch_setters``), and ``set_switches(spec)``, which
sets every one for a spec. bench/long_context.py's A/B policies and bench/full_size.py's BENCH_POLICY use them."""
from __future__ import annotations

from functools import partial


def _table_override(table: dict, key: str, value):
    """A setter for bench switches that change a config table's entry: on -> value, None -> the shipped one."""
    shipped = table[key]

    def setter(on: bool | None) -> None:
        table[key] = value if on else shipped
    return setter


def _attr_override(module, name: str, value):
    """A setter for bench switches that change a module's config constant: on -> value, None -> the shipped one."""
    shipped = getattr(module, name)

    def setter(on: bool | None) -> None:
        setattr(module, name, value if on else shipped)
    return setter


# "+NAME" -> fused_moe/slices.SLICES_CONFIG (BLOCK_I, BLOCK_K8, BLOCK_H, num_warps, stages) while the policy runs
SLICES_POLICIES = {
    # BLOCK_I 16, 4 warps: 384 programs, ~3 on every SM of 132 (the shipped 192 leave 72 SMs with one and 60 with
    # two), twice the atomics
    "slices16": (16, 32, 1024, 4, 1),
    # BLOCK_I 16, BLOCK_K8 64, 8 warps: the fastest MoE block alone on 2026-12-07 (23.4 µs against 24.5 for the
    # shipped config without its routing, 23.5 with it); -3.7% in the model (BENCHMARKS.md)
    "slices1664": (16, 64, 1024, 8, 1),
    # BLOCK_K8 16 on 4 warps: the fastest MoE block alone on 2026-12-07 with per-warp routing (22.3 µs against 23.5,
    # L2-hot; its cold-experts row is in kernels_gpu.py)
    "slices3216": (32, 16, 1024, 4, 1),
    # the gate/up loop: one tile ahead in registers (the pre-Ampere loop; sm80+ until 2026-12-07), or pipelined by
    # Triton (stages >= 2: cp.async into shared memory, sm80+) at BLOCK_K8 32 (shipped until the BLOCK_K8 64 of
    # 2026-12-07), 7 deep; BLOCK_H 512 (unmeasured). (As run on 2026-12-07, "slices_st3" also loaded the down's first
    # chunk before the loop and "slices_st3_late" after it; the early load lost and is gone: BENCHMARKS.md.)
    "slices_one_ahead": (32, 32, 1024, 8, 1),
    "slices_st3": (32, 32, 1024, 8, 3),
    "slices_st8": (32, 32, 1024, 8, 8),
    "slices_st3h512": (32, 32, 512, 8, 3),
    # BLOCK_I 16: 384 programs, 3 on 120 SMs and 2 on 12, where the 192 of BLOCK_I 32 leave 60 SMs with two and 72
    # with one. A two-program SM's gate/up loop is bound by issue (sm90 SASS: 374 instructions a step a warp at 8
    # warps), so those SMs set the launch's time. Per program, warps x (gate/up steps x loop length + down chunks x
    # loop length), sm90 SASS; the busiest SM carries 2 programs at BLOCK_I 32, 3 at 16:
    #   pipelined           (32, 32, 1024, 8, 3)  8 x (8 x 374 + 2 x 604) = 33.6k, x 2 = 67k
    #   slices16_st3        (16, 32, 512, 8, 3)   8 x (8 x 258 + 4 x 270) = 25.2k, x 3 = 76k (76 registers)
    #   slices16w4_st3      (16, 32, 512, 4, 3)   4 x (8 x 378 + 4 x 366) = 18.0k, x 3 = 54k (96 registers)
    #   slices16w4k64_st3   (16, 64, 512, 4, 3)   4 x (4 x 714 + 4 x 365) = 17.3k, x 3 = 52k (128 registers)
    # (each with the down's first chunk before the loop, as measured). In the model (decode12): the two on 4 warps
    # lost to the shipped config (BENCHMARKS.md); fewer instructions on the busiest SM did not pay
    "slices16_st3": (16, 32, 512, 8, 3),
    "slices16w4_st3": (16, 32, 512, 4, 3),
    "slices16w4k64_st3": (16, 64, 512, 4, 3),
    # BLOCK_K8 64 pipelined: 4 gate/up steps of 16 KB (128 registers with the down's chunk loaded late, 205 early;
    # 35 KB shared; unpipelined it took 254)
    "slices_k64_st3": (32, 64, 1024, 8, 3),
    # 3 (4) tiles in flight instead of 2: the shipped tile 4 deep (26 KB shared), BLOCK_K8 64 4 deep (52 KB)
    "slices_st4": (32, 32, 1024, 8, 4),
    "slices_k64_st4": (32, 64, 1024, 8, 4),
}


def switch_setters() -> dict:
    """The "+NAME" parts of a policy spec (the decode paths' on/off switches of kernels/paths.py, two config-table
    entries bench/tune_decode.py found faster alone, and the MoE slices' configs): NAME -> setter(True | None)."""
    from onecard.kernels import paths
    from onecard.kernels.fused_moe import slices, stages
    from onecard.kernels.gptq_gemm import triton as gemm

    # short name -> kernels/paths.py switch (read when a policy's graphs are captured)
    on_off = {"moe_act": "decode_moe_act_launch", "int_dot": "decode_int_dot",
              "b1_acc": "batch1_accumulate",
              "attn_qk": "batch1_attn_qk",                                # (with b1_acc only)
              "moe_slices": "batch1_moe_slices",                          # batch 1 only
              "slices_route": "batch1_slices_route",                      # (with moe_slices only)
              "router_fold": "batch1_router_fold",                        # (with b1_acc, moe_slices, slices_route)
              "slices_half2": "batch1_slices_half2",                      # (with moe_slices; fp16)
              "kv_prefetch": "batch1_kv_prefetch"}                        # batch 1, model-dtype caches
    return {**{short: partial(paths.set_switch, name) for short, name in on_off.items()},
            **{name: _attr_override(slices, "SLICES_CONFIG", cfg) for name, cfg in SLICES_POLICIES.items()},
            # the KV read into L2 ahead of each layer's attention (with kv_prefetch): other budgets than the 24 MB
            **{f"kvpf{mb}": _attr_override(paths, "KV_PREFETCH_MB", mb) for mb in (12, 36)},
            "gemv4": _table_override(gemm.SMALL_PROGRAMS_PER_SM, "gemv", 4),
            "moe1pps8": _table_override(stages.DECODE_CONFIGS, "decode1",
                                        stages.DECODE_CONFIGS["decode1"][:5] + (8,)),
            # decode1 at 6/SM: stage 1's 192 column programs x 4 splits = 768 fit one wave of the 8 per SM its
            # 128 registers allow on 132 SMs (at 8/SM: 6 splits, 1,152 programs, 96 in a second wave)
            "moe1pps6": _table_override(stages.DECODE_CONFIGS, "decode1",
                                        stages.DECODE_CONFIGS["decode1"][:5] + (6,))}


SWITCHES: dict = {}                              # filled on first use (imports onecard)


def set_switches(spec: str) -> None:
    """Every switch of SWITCHES on if spec names it ("fill+int_dot+moe_act"), off if it names it as "no_NAME"
    (a default-on switch A/B'd off: "fill+no_b1_acc"), else back to its default."""
    if not SWITCHES:
        SWITCHES.update(switch_setters())
    named = set(spec.split("+")[1:])
    values = {name: True if name in named else False if f"no_{name}" in named else None for name in SWITCHES}
    # the defaults first: several setters may replace one config constant (slices_st3, slices16, ...), and one
    # left at its default must not put back the shipped value over the one the spec names
    for name in sorted(SWITCHES, key=lambda n: values[n] is not None):
        SWITCHES[name](values[name])
