"""Variants of the CUDA backward's piece kernel, compared on the same synthetic layouts in one
run (GPU), each checked first (one update against its exact value, tools/backward_kernel_bench.cu).

    python tools/backward_kernel_variants.py --out $OUT/bwd [--variants product old ...] [--old-source F]

Each variant is csrc/lookup/kernels.cuh with a textual change (launch bounds, where the row's
weights are read, which groups share their sources) or as it was at a git revision, compiled
into tools/backward_kernel_bench.cu by nvcc (seconds, no torch), then run on the sweep's training
layouts that fbgemm wins (docs/perf-notes.md v18). Prints the plan's and the update's ms, the
update's share of the copy ceiling, the piece kernel's registers and blocks an SM.
"""
import argparse

from kernel_variants import ROOT, SOURCE, compare, source_at

BENCH = ROOT / "tools" / "backward_kernel_bench.cu"

# T ROWS DIM BATCH IDS ZIPF OPT (0 SGD, 2 row-wise Adagrad)
SHAPES = [
    (16, 100000, 4, 4096, 200, 0, 0), (16, 100000, 16, 4096, 50, 0, 0), (16, 100000, 32, 4096, 200, 0, 0),
    (16, 100000, 64, 4096, 200, 0, 0), (16, 100000, 64, 4096, 50, 0, 0), (16, 100000, 128, 4096, 200, 0, 0),
    (16, 100000, 256, 4096, 200, 0, 0), (16, 100000, 256, 4096, 50, 1, 0), (16, 100000, 256, 4096, 10, 0, 2),
    (16, 100000, 512, 4096, 10, 0, 2), (16, 61035, 1024, 4096, 10, 0, 2), (500, 31250, 64, 3200, 10, 0, 0),
    (4000, 3906, 64, 400, 10, 0, 2), (16, 100000, 64, 4096, 1, 0, 0),
]


def _replace(old, new):
    def change(text):
        if old not in text:
            raise SystemExit(f"variant: {old!r} is not in the source")
        return text.replace(old, new)
    return change


def _prefetch_next_piece(text):
    """The group's next piece (its list entry, then its key and first payload) loaded while the
    current one is summed: rows of one lookup (500 and 4000 tables, ~10 ids) spend most of a piece
    in that chain of dependent loads."""
    head = """  for (int64_t r0 = lg.first; r0 < num; r0 += lg.stride) {
    const int64_t r = r0 + lg.sub;
    const bool active = r < num;
    const int64_t packed = active ? a.pieces[r] : 0;
    const int64_t start = packed >> 2;
    const bool split = (packed & 2) != 0;
    const K key = row_key[start];
    const int32_t o_first = order[start];
"""
    prefetched = """  int64_t next = lg.first + lg.sub < num ? a.pieces[lg.first + lg.sub] : 0;
  K next_key = num > 0 ? row_key[next >> 2] : K(0);
  int32_t next_o = num > 0 ? order[next >> 2] : 0;
  for (int64_t r0 = lg.first; r0 < num; r0 += lg.stride) {
    const int64_t r = r0 + lg.sub;
    const bool active = r < num;
    const int64_t packed = active ? next : 0;
    const int64_t start = packed >> 2;
    const bool split = (packed & 2) != 0;
    const K key = next_key;
    const int32_t o_first = next_o;
    next = r + lg.stride < num ? a.pieces[r + lg.stride] : 0;
"""
    tail = "    finish_row<W, OPT, V>(acc, w, state, L, finish, out, row_at, (int64_t)key, a.s1, a.s2, h, t);\n  }\n"
    text = _replace(head, prefetched)(text)
    return _replace(tail, tail[:-4] + "    next_key = row_key[next >> 2];\n    next_o = order[next >> 2];\n  }\n")(text)


SAME = lambda t: t  # noqa: E731


def _unaligned_row_chunks(loads: str, stores: str, streaming: bool):
    """RowLanes' whole 4-wide chunks of rows that are not 16-byte aligned (a dim or table base off a
    multiple of 4, the gradient padded to 16-byte rows) in wider accesses than four of 4 bytes, each
    of which touches every line of the warp's span: `loads` "pieces" (one of 16 bytes where the
    chunk is aligned, two of 8 where it is 8-byte aligned, else 4 + 8 + 4), "realigned" (the two
    aligned 16-byte chunks that hold it, realigned in registers as the forward's pool_realigned
    does) or "columns" (as the product); `stores` "pieces" (as the loads), "pairs" (two of 8 bytes
    where the chunk is 8-byte aligned, else columns) or "columns"; `streaming`: evict-first, as the
    product's aligned rows. v71 ran pieces/pieces/streaming: 1.29-1.43x slower than the product
    on drawn layouts of dims 543 and 960 (partial sectors evicted before their other half lands?)."""
    def ld(ptr: str, width: str) -> str:
        typed = f"reinterpret_cast<const {width}*>({ptr})" if width != "float" else ptr
        return f"__ldcs({typed})" if streaming else f"*({typed})"

    def st(ptr: str, width: str, value: str) -> str:
        typed = f"reinterpret_cast<{width}*>({ptr})" if width != "float" else ptr
        return f"__stcs({typed}, {value});" if streaming else f"*({typed}) = {value};"

    aligned_load = "load4_streaming" if streaming else "load4_rw"
    aligned_store = "store4_streaming" if streaming else "store4"
    if loads == "pieces":
        load_body = f"""  const int s = (int)((reinterpret_cast<uintptr_t>(p) >> 2) & 3);
  if (s == 0) return {aligned_load}(p);
  if (s == 2) {{
    const float2 a = {ld("p", "float2")}, b = {ld("p + 2", "float2")};
    return make_float4(a.x, a.y, b.x, b.y);
  }}
  const float2 b = {ld("p + 1", "float2")};
  return make_float4({ld("p", "float")}, b.x, b.y, {ld("p + 3", "float")});
"""
    else:
        load_body = f"""  const int s = (int)((reinterpret_cast<uintptr_t>(p) >> 2) & 3);
  const float4 lo = {aligned_load}(p - s);
  if (s == 0) return lo;
  return realign(lo, {aligned_load}(p - s + 4), s);  // (p + 3 is in the second chunk)
"""
    odd = (f"""{st("p", "float", "v.x")}
    {st("p + 1", "float2", "make_float2(v.y, v.z)")}
    {st("p + 3", "float", "v.w")}""" if stores == "pieces" else f"""{st("p", "float", "v.x")}
    {st("p + 1", "float", "v.y")}
    {st("p + 2", "float", "v.z")}
    {st("p + 3", "float", "v.w")}""")
    helpers = f"""__device__ __forceinline__ float4 load4_any(const float* p) {{
{load_body}}}
__device__ __forceinline__ void store4_any(float* p, float4 v) {{
  const int s = (int)((reinterpret_cast<uintptr_t>(p) >> 2) & 3);
  if (s == 0) {{
    {aligned_store}(p, v);
  }} else if (s == 2) {{
    {st("p", "float2", "make_float2(v.x, v.y)")}
    {st("p + 2", "float2", "make_float2(v.z, v.w)")}
  }} else {{
    {odd}
  }}
}}

"""
    change = _replace("// Which columns of a row one lane of a group of G covers.",
                      helpers + "// Which columns of a row one lane of a group of G covers.")
    whole = "std::is_same<T, float>::value && vec && at(k, 3) >= 0"
    load = _replace("""      if (at(k, 0) >= 0) v = PLAIN ? load4_rw(src + at(k, 0)) : load4_streaming(src + at(k, 0));
    } else {""", f"""      if (at(k, 0) >= 0) v = PLAIN ? load4_rw(src + at(k, 0)) : load4_streaming(src + at(k, 0));
    }} else if ({whole}) {{
      v = load4_any(reinterpret_cast<const float*>(src) + at(k, 0));
    }} else {{""") if loads != "columns" else SAME
    store = _replace("""    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (at(k, e) >= 0) dst[at(k, e)] = from_f<T>(comp(v, e));""", f"""    }} else if ({whole}) {{
      store4_any(reinterpret_cast<float*>(dst) + at(k, 0), v);
    }} else {{
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (at(k, e) >= 0) dst[at(k, e)] = from_f<T>(comp(v, e));""") if stores != "columns" else SAME
    return lambda text: store(load(change(text)))


# name: (source change, nvcc defines of the bench), as tools/forward_kernel_variants.py
VARIANTS = {
    "product": (SAME, []),
    "old": None,  # --old-source, or the source at --old-revision (default: the last commit's)
    # groups of 4 lanes share their sources too
    "share-all-groups": (_replace("G >= 2 * piece_unroll(V);", "G >= piece_unroll(V);"), []),
    # pieces of at most U lookups (rows read a few times: short bags) resolve their own sources
    "share-long-pieces": (_replace("const bool together = piece_groups_share(V, G);",
                                   "const bool together = piece_groups_share(V, G) && len > U;"), []),
    "v4-2blocks": (_replace("V == 4 ? 3 : 4", "V == 4 ? 2 : 4"), []),  # v19's three blocks an SM at V = 4, undone
    "prefetch-next-piece": (_prefetch_next_piece, []),
    # the fewest lanes a piece at four float4 each (piece_update's `lanes`), e.g. 4 at dim 64: four
    # times the pieces in flight a warp where rows are read about once (500 and 4000 tables)
    "fewest-lanes": (SAME, ["-DPIECE_LANES=-1"]),
    "v1-5blocks": (_replace("V == 4 ? 3 : 4", "V == 4 ? 3 : 5"), []),  # V = 1 at 48 registers, 5 blocks an SM
    # 8 lookups in flight at V = 1, three blocks an SM (64 registers spilled 88-92 bytes)
    "v1-unroll8": (lambda t: _replace("return V >= 8 ? 1 : V == 4 ? 2 : 4;", "return V >= 8 ? 1 : V == 4 ? 2 : 8;")(
        _replace("V == 4 ? 3 : 4", "V == 4 ? 3 : 3")(t)), []),
    # V = 4 (rows of 129-512 columns): four lookups in flight (v19's product; v20 took two, 7-14%
    # faster), the weights read with the gradients, or four blocks an SM
    "v4-u4": (_replace("return V >= 8 ? 1 : V == 4 ? 2 : 4;", "return V >= 8 ? 1 : 4;"), []),
    "v4-early": (_replace("LATE_WEIGHTS = V >= 4;", "LATE_WEIGHTS = V >= 8;"), []),
    "v4-4blocks": (_replace("V == 4 ? 3 : 4", "V == 4 ? 4 : 4"), []),
    # rows of 129-256 columns at two float4 a lane over 32 lanes (V = 2) instead of four over 16
    # (three blocks an SM: at four, 64 registers, it spilled 160 bytes)
    "v2-to-256": (lambda t: _replace("const int V = eight ? 8 : four ? 4 : 1;",
                                     "const int V = eight ? 8 : four ? (lanes == 0 && max_dim <= 256 ? 2 : 4) : 1;")(
        _replace("V >= 8 ? 2 : V == 4 ? 3 : 4", "V >= 8 ? 2 : V >= 2 ? 3 : 4")(t)), []),
    # v21: the piece kernel's shared-memory ring (piece_ring): none at V = 1, eight lookups at V = 1,
    # none at V = 8
    "no-ring-v1": (_replace("V == 1 ? 4 : 0;", "V == 1 ? 0 : 0;"), []),
    "ring-v1-8": (_replace("V == 1 ? 4 : 0;", "V == 1 ? 8 : 0;"), []),
    "no-ring-v8": (_replace("return V == 8 ? 2 :", "return V == 8 ? 0 :"), []),
    # the ring only where groups have 8 lanes or more (the fewest-lanes paths give V = 4 groups of 4)
    "ring-g8": (_replace("if (RING > 0 && together) {", "if (RING > 0 && together && G >= 8) {"), []),
    # v59: deeper rings where two or three blocks an SM leave shared memory for them: V = 8 three
    # lookups (96 KB a block; two lookups ahead in flight, not one), V = 4 four (64 KB a block)
    "ring-v8-3": (_replace("return V == 8 ? 2 :", "return V == 8 ? 3 :"), []),
    "ring-v4-4": (_replace("V == 8 ? 2 : V == 4 ? 3 :", "V == 8 ? 2 : V == 4 ? 4 :"), []),
    # v67: the rows a launch reads and writes once (the weights; also the split rows' partial sums)
    # evict-first in L2 (ld.global.cs, st.global.cs), so that the gradient rows, read by every
    # lookup of their bag, keep their lines. Drawn layouts of tens of millions of lookups (random-0
    # of seed 999034727: 15M distinct rows of dims up to 772) ran their piece kernels at ~1.5 TB/s
    # of rows, and asking L2 for the weights early made them 10-19% slower. Such a layout:
    # --shapes 8,2000000,512,8192,200,0,0 8,2000000,128,16384,50,0,0
    # v70 made the product stream RowLanes' row loads and stores everywhere but the singleton kernel
    # (where the hint spilled); this variant streams the singleton kernel's rows too (v69's form)
    "streaming-rows": (lambda t: _replace(
        "float4 load4_rw(const float* p) { return *reinterpret_cast<const float4*>(p); }",
        "float4 load4_rw(const float* p) { return __ldcs(reinterpret_cast<const float4*>(p)); }")(_replace(
            "void store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }",
            "void store4(float* p, float4 v) { __stcs(reinterpret_cast<float4*>(p), v); }")(t)), []),
    # v71: rows off 16-byte alignment (odd dims, shifted tables) in wider accesses; such layouts:
    # --shapes 1,6834553,543,2048,207,0,0 8,1000000,130,8192,50,0,0 16,100000,257,4096,50,0,0
    #          16,100000,255,4096,10,0,2 16,100000,33,4096,50,0,0 16,100000,256,4096,50,0,0
    "odd-rows-pieces-streaming": (_unaligned_row_chunks("pieces", "pieces", True), []),  # v71's measured change
    "odd-rows-pieces": (_unaligned_row_chunks("pieces", "pieces", False), []),
    "odd-rows-pieces-loads": (_unaligned_row_chunks("pieces", "columns", False), []),
    "odd-rows-realigned": (_unaligned_row_chunks("realigned", "pieces", False), []),
    "odd-rows-realigned-pairs": (_unaligned_row_chunks("realigned", "pairs", False), []),
    "odd-rows-realigned-loads": (_unaligned_row_chunks("realigned", "columns", False), []),
    # v72: both were slower (realigned-pairs 1.08-1.15x the product's update at dims 33-257; random-6's
    # step 1.17x), while the same layout at an aligned 544 columns updated in 0.77 ms against 543's
    # 1.11. Rows off 16-byte alignment in the lane-per-column layout instead (the gradient too, as
    # before v58): each warp access 32 neighbouring columns, one or two lines, where the 4-wide
    # layout's column accesses touch four.
    "odd-rows-columns": (_replace(
        "return RowLanes{grad_vec, grad_vec && dim % 4 == 0 && base % 4 == 0, sl, G, dim};",
        "const bool aligned = grad_vec && dim % 4 == 0 && base % 4 == 0;\n  return RowLanes{aligned, aligned, sl, G, dim};"), []),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/bwd")
    p.add_argument("--variants", nargs="*", default=[name for name in VARIANTS if name != "old"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--old-revision", default="HEAD", help="git revision of the 'old' variant's source (from v19 on: "
                                                          "the bench calls the kernels as they are now)")
    p.add_argument("--old-source", help="the 'old' variant's source file (where the git history is not at hand, "
                                        "as on the device machine: write it with git show and carry it)")
    p.add_argument("--lanes", type=int, help="every variant's PIECE_LANES (-1: the fewest lanes, pooled_cuda's "
                                              "'fewest lanes' paths; default: each variant's own)")
    p.add_argument("--shapes", nargs="*", help="layouts to run (T,ROWS,DIM,BATCH,IDS,ZIPF,OPT each; default: all of "
                                                 "SHAPES)")
    p.add_argument("--ncu", action="store_true", help="Nsight Compute's counters of one piece kernel launch a variant "
                                                      "and shape instead of the timed runs (kernel_variants.NCU_METRICS)")
    args = p.parse_args()
    text = SOURCE.read_text()

    def old():
        text = open(args.old_source).read() if args.old_source else source_at(args.old_revision)
        if "piece_ring_bytes" not in text:  # before v21's ring: the bench launches with no shared memory
            text += "\nnamespace {\ninline size_t piece_ring_bytes(int, int) { return 0; }\n}  // namespace\n"
        if "make_payload" not in text:  # before v36's BatchDivisor: the payload built as an aggregate
            text += ("\nnamespace {\ninline Payload make_payload(int32_t b, bool v, int64_t t, const int64_t* m, "
                     "const float* bs, const int64_t* s, const float* sc, const int32_t* f) {\n"
                     "  return Payload{b, v, t, m, bs, s, sc, f};\n}\n}  // namespace\n")
        if "fewest_piece_lanes" not in text:  # before v37: the bench's lanes spelled out
            text += ("\nnamespace {\ninline int fewest_piece_lanes(int64_t dim) { return group_lanes((int)((dim + 15) / 16)); "
                     "}\n}  // namespace\n")
        return text

    chosen = {name: (old(), []) if name == "old" else (VARIANTS[name][0](text), VARIANTS[name][1])
              for name in args.variants}
    if args.lanes is not None:
        lanes = f"-DPIECE_LANES={args.lanes}"
        chosen = {name: (src, [d for d in defines if not d.startswith("-DPIECE_LANES")] + [lanes])
                  for name, (src, defines) in chosen.items()}
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    compare(chosen, BENCH, args.out, "piece_kernel", shapes, args.iters, args.ncu)


if __name__ == "__main__":
    main()
