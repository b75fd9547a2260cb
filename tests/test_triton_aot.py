"""The pure parts of ``tests/triton_aot.py`` (launch hints, reading ptxas's report and the PTX,
the failure rules) on small hand-written inputs: nothing is compiled here."""

import pytest

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import triton_aot  # noqa: E402

PTXAS_LOG = """ptxas info    : Compiling entry function 'kernel' for 'sm_90a'
ptxas info    : Function properties for kernel
    536 bytes stack frame, 528 bytes spill stores, 532 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 536 bytes cumulative stack size
"""

PTX = """
.visible .entry kernel(
	.param .u64 .ptr .global .align 16 kernel_param_0
)
{
	cp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;
	cp.async.commit_group;
	st.local.v4.u32 	[%rd9], {%r3, %r4, %r5, %r6};   // outside every loop
	@%p1 bra 	$L__BB0_4;                             // forward: not a loop
$L__BB0_1:                                              // outer loop
	cp.async.ca.shared.global [ %r1 + 16 ], [ %rd1 + 16 ], 0x10, %r2;
	cp.async.wait_group 1;
	wgmma.fence.sync.aligned;
	wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1}, %rd2, %rd3, p, 1, 1, 0, 1;
$L__BB0_2:                                              // inner loop
	ld.local.u32 	%r7, [%rd9];
	wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f2}, %rd4, %rd5, p, 1, 1, 0, 1;
	@%p2 bra 	$L__BB0_2;
	st.local.u32 	[%rd9], %r7;
	@%p3 bra 	$L__BB0_1;
	// ld.local.u32 %r9, [%rd9]; a comment, not an instruction
$L__BB0_4:
	cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r8], [%rd6];
	ld.local.u32 	%r10, [%rd9];
	ret;
}
"""


def test_parse_ptxas_log_reads_registers_and_spills():
    assert triton_aot.parse_ptxas_log(PTXAS_LOG) == {"registers": 255, "spill_bytes": 528}
    assert triton_aot.parse_ptxas_log("ptxas info : Used 32 registers")["spill_bytes"] == 0


def test_loop_lines_are_between_a_label_and_its_backward_branch():
    lines = triton_aot.ptx_instructions(PTX)
    inside = {lines[i] for i in triton_aot.loop_lines(lines)}
    assert any(line.startswith("ld.local") for line in inside)
    assert any(line.startswith("st.local.u32") for line in inside)
    assert not any(line.startswith("st.local.v4") for line in inside)  # before the loops
    assert not any(line.startswith("cp.async.bulk") for line in inside)  # after a forward branch
    assert not any(line.startswith("ret") for line in inside)


def test_ptx_counts():
    counts = triton_aot.ptx_counts(PTX)
    assert counts == {"cp_async": 2, "tma": 1, "wgmma": True, "wgmma_count": 2,
                      "wgmma_shapes": ["m64n64k16", "m64n128k16"], "local_in_loops": 2}
    plain = triton_aot.ptx_counts("ld.global.u32 %r1, [%rd1];\nret;")
    assert plain == {"cp_async": 0, "tma": 0, "wgmma": False, "wgmma_count": 0,
                     "wgmma_shapes": [], "local_in_loops": 0}


def _row(**fields):
    return dict({"ptxas_ok": True, "spill_bytes": 0, "shared_bytes": 0}, **fields)


def test_failure_reasons():
    limit = triton_aot.SM90_SHARED_BYTES
    assert limit == 227 * 1024
    assert triton_aot.failure_reasons(_row(shared_bytes=limit), False) == []
    [reason] = triton_aot.failure_reasons(_row(shared_bytes=limit + 1), True)
    assert "shared memory" in reason and str(limit + 1) in reason
    [reason] = triton_aot.failure_reasons(_row(spill_bytes=8), False)
    assert "spills 8 bytes" in reason
    assert triton_aot.failure_reasons(_row(spill_bytes=8), True) == []
    assert triton_aot.failure_reasons(_row(ptxas_ok=False), False) == ["ptxas failed"]
    [reason] = triton_aot.failure_reasons(_row(hinted_args=3, divisible_args=0), False)
    assert "0 arguments divisible by 16 in the TTIR, 3 hinted" == reason
    [reason] = triton_aot.failure_reasons(_row(narrow_mma_stores=["128x32 swizzle 64"]), True)
    assert "narrow swizzle (128x32 swizzle 64)" in reason  # spills allowed or not


# The layouts and stores of a D 128 backward's TTGIR (triton 3.6 / 3.8, shortened): the wgmma
# result dS^T stored with a 64-byte swizzle (%ds), a loaded tile with 128 (%k), and a wgmma
# result in a 128-byte layout (%ok).
TTGIR = """#blocked = #ttg.blocked<{sizePerThread = [1, 8], threadsPerWarp = [2, 16], warpsPerCTA = [8, 1], order = [1, 0]}>
#mma = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [8, 1], instrShape = [16, 32, 16]}>
#mma1 = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [1, 8], instrShape = [16, 8]}>
#shared = #ttg.nvmma_shared<{swizzlingByteWidth = 128, transposed = false, elementBitWidth = 16}>
#shared2 = #ttg.nvmma_shared<{swizzlingByteWidth = 64, transposed = false, elementBitWidth = 16}>
#shared3 = #ttg.swizzled_shared<{vec = 8, perPhase = 1, maxPhase = 8, order = [1, 0]}>
    %k_1 = ttg.local_alloc %k : (tensor<128x128xbf16, #blocked>) -> !ttg.memdesc<128x128xbf16, #shared, #smem> loc(#loc1)
    %ds_2 = ttg.local_alloc %ds : (tensor<128x32xbf16, #mma>) -> !ttg.memdesc<128x32xbf16, #shared2, #smem> loc(#loc2)
    %ok_3 = ttg.local_alloc %ok : (tensor<64x64xbf16, #mma>) -> !ttg.memdesc<64x64xbf16, #shared, #smem> loc(#loc3)
    %v2_4 = ttg.local_alloc %v2 : (tensor<32x128xbf16, #mma1>) -> !ttg.memdesc<32x128xbf16, #shared3, #smem> loc(#loc4)
"""


def test_narrow_mma_stores_finds_a_wgmma_result_stored_with_a_narrow_swizzle():
    assert triton_aot.narrow_mma_stores(TTGIR) == ["128x32 swizzle 64"]
    wide = TTGIR.replace("swizzlingByteWidth = 64", "swizzlingByteWidth = 128")
    assert triton_aot.narrow_mma_stores(wide) == []


TTIR = """module {
  tt.func public @kernel(%X: !tt.ptr<bf16> {tt.divisibility = 16 : i32} loc("X"(#loc)), %n: i32
      loc("n"(#loc)), %stride: i32 {tt.divisibility = 16 : i32} loc("stride"(#loc))) attributes
      {noinline = false} {
    %0 = tt.get_program_id x : i32 loc(#loc1)
    tt.call @helper(%X) {tt.divisibility = 16 : i32} : (!tt.ptr<bf16>) -> () loc(#loc2)
    tt.return loc(#loc3)
  } loc(#loc)
}"""


def test_divisible_arguments_counts_the_entry_function_signature_only():
    assert triton_aot.divisible_arguments(TTIR) == 2
    assert triton_aot.divisible_arguments("module {}") == 0


@triton.jit
def _kernel(X, Y, stride, n, unit, scale, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs * stride * unit, tl.load(X + offs, mask=offs < n) * scale)


def _spec(**hints):
    return {"name": "probe", "fn": _kernel, "constexprs": {"BLOCK": 16}, "hints": hints,
            "signature": {"X": "*bf16", "Y": "*fp32", "stride": "i32", "n": "i32", "unit": "i32",
                          "scale": "fp32", "BLOCK": "constexpr"}}


def test_hinted_source_marks_pointers_and_named_integers():
    source = triton_aot.hinted_source(_spec(divisible_by_16=["stride"], equal_to_1=["unit"]))
    divisible = triton_aot.divisibility_attr()
    assert divisible == [["tt.divisibility", 16]]  # the format of triton 3.6 to 3.8
    assert source.attrs == {(0,): divisible, (1,): divisible, (2,): divisible}
    assert source.signature["unit"] == "constexpr"
    assert source.constants[(4,)] == 1 and source.constants[(6,)] == 16
    bare = triton_aot.hinted_source(_spec())  # default: pointers only
    assert set(bare.attrs) == {(0,), (1,)} and bare.signature["unit"] == "i32"


@pytest.mark.parametrize("hints", [{"divisible_by_16": ["scale"]}, {"equal_to_1": ["X"]},
                                   {"divisible_by_16": ["missing"]}, {"aligned": ["n"]}])
def test_hints_must_name_integer_arguments(hints):
    with pytest.raises(ValueError, match="probe"):
        triton_aot.launch_hints(_spec(**hints))


def test_the_prefix_dkdv_launch_without_splits_is_compiled_as_launched():
    """A hot prefix dk/dv launch with one split (``splits`` 1, ``extra`` 0, which triton
    specialises as a constant and as divisible by 16) is a compile of its own: its twin spec
    has those hints, and no tuning variants of its own."""
    modules = {m.__name__.rsplit(".", 1)[-1]: m for m in triton_aot.load_kernel_modules()}
    specs = {s["name"]: s for s in modules["varlen_attention_prefix"].aot_specs()}
    for dtype in ("bf16", "fp16"):
        for head_dim in (64, 128):
            for kind in ("", "_dkdv"):
                name = f"varlen_attention_prefix_backward{kind}_{dtype}_d{head_dim}"
                twin = specs[name + "_one_split"]
                assert twin["hints"]["equal_to_1"] == ["splits"] and "tuning" not in twin
                assert "extra" in twin["hints"]["divisible_by_16"]
                assert "extra" not in specs[name]["hints"]["divisible_by_16"]
                assert triton_aot.hinted_source(twin).signature["splits"] == "constexpr"
    assert not any(n.endswith("_one_split") for n in specs if "fp32" in n or "d256" in n)
