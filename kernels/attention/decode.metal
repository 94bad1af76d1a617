// Decode attention (one query row per sequence) of the Qwen3.5/3.6 full-attention layers.
//
// For query head h of sequence b, with its KV head hkv = h / G (G = Hq / Hkv query heads per KV head):
//   out[b, h] = sum_s softmax_s(scale * q[b, h] . k[b, hkv, s]) v[b, hkv, s]
// over the S live rows of a contiguous KV cache [B, Hkv, S_cap, D] (rows S.. are unused capacity).
// Softmax in fp32 with a running max and sum (online softmax); inputs and output in InT.
//
// Thread layout. One threadgroup = SG simdgroups of 32 lanes handles GT query heads of one KV head
// (switch gqa_packing: GT = G, every K/V row is read once for all G heads; off: GT = 1, one
// threadgroup per query head, rows read once per head) over a range of KV rows. The simdgroups take
// steps of R consecutive rows: simdgroup sg's step t covers rows begin + (t * SG + sg) * R + r, r < R,
// so a threadgroup streams SG * R contiguous rows per step. The 32 lanes split each row's D
// elements, EPL = D / 32 per lane; the same lane owns the same elements of q, K, V and of its
// accumulators. Which elements, and how they are read, is the coalesced_kv switch:
//   on:  the lane's elements are chunks of W = min(EPL, 16 bytes) contiguous elements, chunk c at
//        element (c * 32 + lane) * W: one 4/8/16-byte load per chunk, adjacent lanes reading
//        adjacent bytes (at D = 256, bf16: one 16-byte load per lane covers the whole 512-byte row);
//   off: ("strided") the lane owns the run lane * EPL .. lane * EPL + EPL - 1 and reads it one
//        element at a time (2-byte loads at bf16, EPL elements apart across lanes).
// The loads of the next step are issued before the current step is computed (double buffering).
//
// Per step (R rows x GT heads): each lane forms the partial dot products of its elements for all
// N = GP * R (head, row) pairs (GP = GT rounded up to a power of two); one transposing butterfly
// reduces the N values over the 32 lanes with N - 1 + log2(32 / N) shuffles (not N * 5), leaving lane
// L with the full score of pair L >> (5 - log2 N); so each lane computes one exp for one (head, row)
// (not every lane every exp). The running max of a head moves only when its chunk max is larger; the
// accumulators are rescaled only then (a simdgroup vote). Each lane then takes the GT * R weights by
// simd_shuffle and adds p * v into its fp32 accumulators. At the end the simdgroups' partials (max,
// sum, unnormalised output per head) are merged through threadgroup memory.
//
// Kernels:
// - attention_decode: one threadgroup per (KV head, GT heads) over all S rows, writes the output.
// - attention_decode_block_partials (switch fixed_block_attention): the rows cut into NB blocks of
//   BR rows (BR chosen by the host from S alone), one threadgroup per (block, GT heads); writes fp32
//   partials per head and block: max, sum of exp(score - max), unnormalised sum of exp(...) v.
// - attention_decode_block_partials_live (switch kv_write_in_trace): the same over a buffer's whole
//   capacity with the live length read from an input array (blocks past it write nothing).
// - attention_decode_block_partials_rows: the same over a batch's rows (BatchKVCache), each row's blocks from its
//   left padding on and of its own length's size (attention_decode_merge_row_blocks merges them).
// - attention_decode_merge_blocks: per (head, slice of D), warps split the blocks, rescale them to
//   the global max and sum in a fixed order; divides once. attention_decode_merge_live_blocks: the same over
//   the live form's live blocks; ..._gated (switch fused_output_gate): times the layer's output gate.
// - attention_decode_quantized, attention_decode_block_partials_quantized: the one-pass kernel and the block
//   partials over an MLX-LM QuantizedKVCache (AttentionQuantizedRows: packed rows dequantised in registers);
//   attention_decode_block_partials_live_quantized: the live-length form's partials over such a cache.
//
// Conventions: sizes in an int32 `params` array; InT, D, GT, SG, R, COALESCED as template arguments;
// threadgroup (32, SG, 1); every lane reaches every simd op and every thread every barrier (loop
// bounds are uniform per simdgroup / threadgroup).

// @header
// Running max before any row: finite, so exp(m - m_new) is a plain underflow to 0 (no inf arithmetic).
#define ATTENTION_NO_MAX (-3.0e38f)

// 16- and 8-byte words for wide loads (16- and 8-byte aligned, as Metal's uint4 / uint2).
typedef uint4 attention_u4;
typedef uint2 attention_u2;

// K/V elements held as 32-bit words: PER elements per word, element h of word w as a float, and the
// bits of one element (for packing words from scalar loads).
template <typename T> struct AttentionWords;
template <> struct AttentionWords<bfloat16_t> {
  static constant constexpr int PER = 2;
  static inline float get(uint w, int h) { return as_type<float>(h ? (w & 0xffff0000u) : (w << 16)); }
  static inline uint bits(bfloat16_t x) { return static_cast<uint>(as_type<ushort>(x)); }
};
template <> struct AttentionWords<half> {
  static constant constexpr int PER = 2;
  static inline float get(uint w, int h) { return static_cast<float>(as_type<half>(static_cast<ushort>(h ? (w >> 16) : (w & 0xffffu)))); }
  static inline uint bits(half x) { return static_cast<uint>(as_type<ushort>(x)); }
};
template <> struct AttentionWords<float> {
  static constant constexpr int PER = 1;
  static inline float get(uint w, int h) { return as_type<float>(w); }
  static inline uint bits(float x) { return as_type<uint>(x); }
};

// NW consecutive 32-bit words from p (16-byte / 8-byte / 4-byte aligned) in one load.
template <int NW> struct AttentionLoad;
template <> struct AttentionLoad<4> {
  template <typename T>
  static inline void load(const device T* p, thread uint* w) {
    const attention_u4 t = *reinterpret_cast<const device attention_u4*>(p);
    w[0] = t.x;
    w[1] = t.y;
    w[2] = t.z;
    w[3] = t.w;
  }
};
template <> struct AttentionLoad<2> {
  template <typename T>
  static inline void load(const device T* p, thread uint* w) {
    const attention_u2 t = *reinterpret_cast<const device attention_u2*>(p);
    w[0] = t.x;
    w[1] = t.y;
  }
};
template <> struct AttentionLoad<1> {
  template <typename T>
  static inline void load(const device T* p, thread uint* w) { w[0] = *reinterpret_cast<const device uint*>(p); }
};

// Compile-time sizes of the row loop (see the file comment).
template <typename InT, int D, int GT, int R>
struct AttentionShape {
  static constant constexpr int EPL = D / 32;                          // elements per lane
  static constant constexpr int PER = AttentionWords<InT>::PER;        // elements per 32-bit word
  static constant constexpr int WPL = EPL / PER;                       // words per lane and row
  static constant constexpr int W = (EPL * static_cast<int>(sizeof(InT)) >= 16) ? 16 / static_cast<int>(sizeof(InT)) : EPL;
  static constant constexpr int NCH = EPL / W;                         // chunks (wide loads) per lane and row
  static constant constexpr int NW = W / PER;                          // words per chunk
  static constant constexpr int GP = GT <= 1 ? 1 : GT <= 2 ? 2 : GT <= 4 ? 4 : GT <= 8 ? 8 : GT <= 16 ? 16 : 32;
  static constant constexpr int N = GP * R;                            // (head, row) pairs per step
  static constant constexpr int LOGN = N <= 1 ? 0 : N <= 2 ? 1 : N <= 4 ? 2 : N <= 8 ? 3 : N <= 16 ? 4 : 5;
  static constant constexpr int SH = 5 - LOGN;                         // lane L holds pair L >> SH
};

// Element of a D-wide row that lane `lane` holds in its slot i (see the layout above).
template <int D, int W, int COALESCED>
inline int attention_element(int lane, int i) {
  return COALESCED ? ((i / W) * 32 + lane) * W + i % W : lane * (D / 32) + i;
}

// The lane's words of one row (zeros, no read, for a row at or past row_end).
template <typename InT, int D, int GT, int R, int COALESCED>
inline void attention_load_row(const device InT* rows, int row, int row_end, int lane, thread uint* w) {
  typedef AttentionShape<InT, D, GT, R> Shape;
  if (row >= row_end) {  // uniform over the simdgroup
    for (int j = 0; j < Shape::WPL; ++j) {
      w[j] = 0u;
    }
    return;
  }
  const device InT* base = rows + static_cast<size_t>(row) * D;
  if (COALESCED) {
    for (int c = 0; c < Shape::NCH; ++c) {
      AttentionLoad<Shape::NW>::load(base + (c * 32 + lane) * Shape::W, w + c * Shape::NW);
    }
  } else {
    for (int j = 0; j < Shape::WPL; ++j) {
      uint word = 0u;
      for (int h = 0; h < Shape::PER; ++h) {
        word |= AttentionWords<InT>::bits(base[lane * Shape::EPL + j * Shape::PER + h]) << (16 * h);
      }
      w[j] = word;
    }
  }
}

// Where a K or V row comes from, as the row loop reads it (the KV template argument of attention_decode_rows):
//   WORDS: 32-bit words a lane holds of one row; head(bh, S_cap): the rows of KV head bh (= b * Hkv + hkv) of a
//   [B, Hkv, S_cap, ...] cache; load(row, row_end, lane, w): the lane's words of a row (zeros at or past row_end);
//   element(w, i): the lane's element i (of EPL = D / 32) of a row as a float.
// AttentionPlainRows: K or V as [B, Hkv, S_cap, D] InT, the lane's elements as in the file comment.
template <typename InT, int D, int COALESCED>
struct AttentionPlainRows {
  typedef AttentionShape<InT, D, 1, 1> Shape;
  static constant constexpr int WORDS = Shape::WPL;
  const device InT* rows;

  inline AttentionPlainRows head(int bh, int S_cap) const {
    return AttentionPlainRows{rows + static_cast<size_t>(bh) * S_cap * D};
  }
  inline void load(int row, int row_end, int lane, thread uint* w) const {
    attention_load_row<InT, D, 1, 1, COALESCED>(rows, row, row_end, lane, w);
  }
  static inline float element(const thread uint* w, int i) {
    return AttentionWords<InT>::get(w[i / Shape::PER], i % Shape::PER);
  }
};

// AttentionQuantizedRows: K or V of an MLX-LM QuantizedKVCache, affine BITS-bit (2, 4 or 8) with groups of GROUP
// elements: packed [B, Hkv, S_cap, D * BITS / 32] uint32 (element e of a row at bits (e * BITS) % 32 of word
// e * BITS / 32, as mx.quantize packs), scales and biases [B, Hkv, S_cap, D / GROUP] InT; element = scale * q + bias
// in fp32. The lane owns the contiguous elements lane * EPL .. + EPL - 1 (the strided ownership; EPL divides GROUP,
// so they share one scale and one bias): its EPL * BITS bits (a part of a word at D * BITS < 1024, one word
// shifted down to them), then the scale and bias as fp32 bits. PP, SP: the packed words' and the scales' pointer
// types (Metal passes inputs of under 8 elements as `constant`).
template <typename InT, int D, int BITS, int GROUP, typename PP, typename SP>
struct AttentionQuantizedRows {
  static constant constexpr int EPL = D / 32;
  static constant constexpr int LANE_BITS = EPL * BITS;
  static constant constexpr int PACKED = LANE_BITS >= 32 ? LANE_BITS / 32 : 1;  // words of packed bits
  static constant constexpr int WORDS = PACKED + 2;
  static constant constexpr int ROW_WORDS = D * BITS / 32;
  static constant constexpr int GROUPS = D / GROUP;
  static_assert(BITS == 2 || BITS == 4 || BITS == 8, "2-, 4- or 8-bit elements (no element straddles two words)");
  static_assert(GROUP % EPL == 0 && D % GROUP == 0, "a lane's elements in one group");
  static_assert(LANE_BITS < 32 || LANE_BITS % 32 == 0, "a lane's bits in whole words or in part of one");
  PP packed;
  SP scales;
  SP biases;

  inline AttentionQuantizedRows head(int bh, int S_cap) const {
    const size_t row0 = static_cast<size_t>(bh) * S_cap;
    return AttentionQuantizedRows{packed + row0 * ROW_WORDS, scales + row0 * GROUPS, biases + row0 * GROUPS};
  }
  inline void load(int row, int row_end, int lane, thread uint* w) const {
    if (row >= row_end) {  // uniform over the simdgroup; zeros decode to 0 (scale 0, bias 0)
      for (int j = 0; j < WORDS; ++j) {
        w[j] = 0u;
      }
      return;
    }
    const PP p = packed + static_cast<size_t>(row) * ROW_WORDS;
    if (LANE_BITS >= 32) {
      for (int j = 0; j < PACKED; ++j) {
        w[j] = p[lane * PACKED + j];
      }
    } else {
      const int bit = lane * LANE_BITS;
      w[0] = p[bit / 32] >> (bit % 32);
    }
    const size_t g = static_cast<size_t>(row) * GROUPS + (lane * EPL) / GROUP;
    w[PACKED] = as_type<uint>(static_cast<float>(scales[g]));
    w[PACKED + 1] = as_type<uint>(static_cast<float>(biases[g]));
  }
  static inline float element(const thread uint* w, int i) {
    const uint q = (w[(i * BITS) / 32] >> ((i * BITS) % 32)) & ((1u << BITS) - 1u);
    return static_cast<float>(q) * as_type<float>(w[PACKED]) + as_type<float>(w[PACKED + 1]);
  }
};

// The decode attention of one threadgroup over KV rows [row_begin, row_end): GT query heads of KV
// head `bh` (= b * Hkv + hkv), first query head h0; k and v the cache's rows (KV: AttentionPlainRows or
// AttentionQuantizedRows). The simdgroups' partials are merged through
// threadgroup memory (sg_max, sg_sum: GT * SG floats; sg_acc: SG * HP * D floats, HP heads at a
// time). PARTIAL == 0: writes the normalised output rows of `out` ([B * Hq, D], InT). PARTIAL == 1:
// writes this block's fp32 partial of each head instead, its max, sum of exp(score - max) and
// unnormalised sum of exp(score - max) * v, at index `part` of part_max / part_sum ([B * Hq, NB]) and
// part_acc ([B * Hq, NB, D]); the merge kernel combines them.
template <typename InT, int D, int GT, int SG, int R, int COALESCED, int PARTIAL, int HP, typename KV>
inline void attention_decode_rows(
    const device InT* q, const thread KV& k, const thread KV& v, float qk_scale,
    device InT* out, device float* part_max, device float* part_sum, device float* part_acc,
    int Hq, int S_cap, int bh, int b_idx, int h0, int row_begin, int row_end, int part, int NB,
    threadgroup float* sg_max, threadgroup float* sg_sum, threadgroup float* sg_acc, int lane, int sg) {
  typedef AttentionShape<InT, D, GT, R> Shape;
  constexpr int EPL = Shape::EPL;
  constexpr int PER = Shape::PER;
  constexpr int WPL = Shape::WPL;
  constexpr int N = Shape::N;
  constexpr int SH = Shape::SH;
  static_assert(Shape::N <= 32, "GT (rounded up to a power of two) * R must be at most 32");
  static_assert(EPL % PER == 0 && EPL % Shape::W == 0, "D / 32 elements per lane in whole words");

  float qr[GT][EPL];   // scaled query elements of this lane
  float acc[GT][EPL];  // unnormalised output elements of this lane
  for (int g = 0; g < GT; ++g) {
    // A query row is read like a K row (16-byte loads when coalesced: 8 a lane at D = 256 and 8 heads, not 64
    // scalar ones, each a strided access over 16 sectors).
    uint qw[WPL];
    attention_load_row<InT, D, GT, R, COALESCED>(q + (static_cast<size_t>(b_idx) * Hq + h0 + g) * D, 0, 1, lane, qw);
    for (int j = 0; j < WPL; ++j) {
      for (int h = 0; h < PER; ++h) {
        qr[g][j * PER + h] = AttentionWords<InT>::get(qw[j], h) * qk_scale;
        acc[g][j * PER + h] = 0.0f;
      }
    }
  }
  // This lane's (head, row) pair after the transposing reduction: head g_l, row r_l of each step.
  const int pair = lane >> SH;
  const int g_l = pair / R;
  const int r_l = pair % R;
  float m = ATTENTION_NO_MAX;  // running max of head g_l (uniform over the lanes of that head)
  float l = 0.0f;              // this lane's share of head g_l's running sum (its rows r_l)

  constexpr int KW = KV::WORDS;
  const KV k_rows = k.head(bh, S_cap);
  const KV v_rows = v.head(bh, S_cap);
  uint kw[R][KW];  // the step's rows as loaded words (next step's while computing this one)
  uint vw[R][KW];
  int base = row_begin + sg * R;
  for (int r = 0; r < R; ++r) {
    k_rows.load(base + r, row_end, lane, kw[r]);
    v_rows.load(base + r, row_end, lane, vw[r]);
  }
  for (; base < row_end; base += SG * R) {  // uniform over the simdgroup
    uint kc[R][KW];
    uint vc[R][KW];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < KW; ++j) {
        kc[r][j] = kw[r][j];
        vc[r][j] = vw[r][j];
      }
    }
    for (int r = 0; r < R; ++r) {  // issue the next step's loads before computing this step
      k_rows.load(base + SG * R + r, row_end, lane, kw[r]);
      v_rows.load(base + SG * R + r, row_end, lane, vw[r]);
    }

    // Partial dot products of this lane's elements, pair index g * R + r (padding heads stay 0).
    float pd[N];
    for (int n = 0; n < N; ++n) {
      pd[n] = 0.0f;
    }
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < EPL; ++i) {
        const float kf = KV::element(kc[r], i);
        for (int g = 0; g < GT; ++g) {
          pd[g * R + r] += qr[g][i] * kf;
        }
      }
    }
    // Transposing butterfly: at offset 16 >> s each lane keeps the half of its values selected by
    // that lane bit and adds its partner's copy of that half; then the plain butterfly over the
    // remaining low lane bits. Lane L ends with the full score of pair L >> SH.
    for (int s = 0; s < Shape::LOGN; ++s) {
      const int half_n = N >> (s + 1);
      const bool upper = (lane & (16 >> s)) != 0;
      for (int n = 0; n < half_n; ++n) {
        const float keep = upper ? pd[n + half_n] : pd[n];
        const float send = upper ? pd[n] : pd[n + half_n];
        pd[n] = keep + simd_shuffle_xor(send, static_cast<ushort>(16 >> s));
      }
    }
    float score = pd[0];
    for (int o = 16 >> Shape::LOGN; o >= 1; o >>= 1) {
      score += simd_shuffle_xor(score, static_cast<ushort>(o));
    }
    if (base + r_l >= row_end) {
      score = ATTENTION_NO_MAX;  // a row past the range: weight 0, never the max
    }
    // Online softmax of head g_l over its R rows of this step.
    float chunk_max = score;
    for (int o = 1 << SH; o < (R << SH); o <<= 1) {
      chunk_max = fmax(chunk_max, simd_shuffle_xor(chunk_max, static_cast<ushort>(o)));
    }
    const float m_new = fmax(m, chunk_max);
    const float correction = exp(m - m_new);
    const float p = exp(score - m_new);
    l = l * correction + p;
    m = m_new;
    if (!simd_all(correction == 1.0f)) {  // some head's max moved: rescale its accumulators
      for (int g = 0; g < GT; ++g) {
        const float c_g = simd_shuffle(correction, static_cast<ushort>((g * R) << SH));
        for (int i = 0; i < EPL; ++i) {
          acc[g][i] *= c_g;
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      float vf[EPL];
      for (int i = 0; i < EPL; ++i) {
        vf[i] = KV::element(vc[r], i);
      }
      for (int g = 0; g < GT; ++g) {
        const float p_gr = simd_shuffle(p, static_cast<ushort>((g * R + r) << SH));
        for (int i = 0; i < EPL; ++i) {
          acc[g][i] += p_gr * vf[i];
        }
      }
    }
  }
  // Head g_l's sum over this simdgroup's rows: the lanes of its R rows (copies in the low bits).
  for (int o = 1 << SH; o < (R << SH); o <<= 1) {
    l += simd_shuffle_xor(l, static_cast<ushort>(o));
  }

  // Merge the simdgroups' partials: maxes and sums first, then HP heads' accumulators at a time.
  if ((lane & ((R << SH) - 1)) == 0 && g_l < GT) {
    sg_max[g_l * SG + sg] = m;
    sg_sum[g_l * SG + sg] = l;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const int tid = sg * 32 + lane;
  for (int g0 = 0; g0 < GT; g0 += HP) {
    for (int hh = 0; hh < HP; ++hh) {
      const int g = g0 + hh;
      if (g < GT) {
        float m_all = ATTENTION_NO_MAX;
        for (int s = 0; s < SG; ++s) {
          m_all = fmax(m_all, sg_max[g * SG + s]);
        }
        const float weight = exp(sg_max[g * SG + sg] - m_all);  // a simdgroup without rows: 0
        for (int i = 0; i < EPL; ++i) {
          sg_acc[(sg * HP + hh) * D + attention_element<D, Shape::W, COALESCED>(lane, i)] = acc[g][i] * weight;
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int t = tid; t < HP * D; t += 32 * SG) {
      const int hh = t / D;
      const int d = t % D;
      const int g = g0 + hh;
      if (g < GT) {
        float m_all = ATTENTION_NO_MAX;
        for (int s = 0; s < SG; ++s) {
          m_all = fmax(m_all, sg_max[g * SG + s]);
        }
        float total = 0.0f;
        float o = 0.0f;
        for (int s = 0; s < SG; ++s) {
          total += sg_sum[g * SG + s] * exp(sg_max[g * SG + s] - m_all);
          o += sg_acc[(s * HP + hh) * D + d];
        }
        const size_t head = static_cast<size_t>(b_idx) * Hq + h0 + g;
        if (PARTIAL) {
          part_acc[(head * NB + part) * D + d] = o;
          if (d == 0) {
            part_max[head * NB + part] = m_all;
            part_sum[head * NB + part] = total;
          }
        } else {
          out[head * D + d] = static_cast<InT>(o / total);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // sg_acc is rewritten for the next heads
  }
}

// Heads whose accumulators fit the threadgroup's 16 KiB merge buffer at once.
#define ATTENTION_MERGE_HEADS(GT, SG, D) ((GT) * (SG) * (D) <= 4096 ? (GT) : (4096 / ((SG) * (D)) > 0 ? 4096 / ((SG) * (D)) : 1))

// One threadgroup of the fixed-block split: threadgroup z = n * NB + block (n: the (KV head, GT heads)
// group) over rows [block * BR, min(S, block * BR + BR)) of the S live rows. A block at or past S has no
// rows and writes an empty partial (max ATTENTION_NO_MAX, sum 0, acc 0), which the merge weighs exactly 0.
template <typename InT, int D, int GT, int SG, int R, int COALESCED, int HP, typename KV>
inline void attention_decode_block(
    const device InT* q, const thread KV& k, const thread KV& v, float qk_scale,
    device float* part_max, device float* part_sum, device float* part_acc,
    int Hkv, int G, int S, int S_cap, int NB, int BR, int z,
    threadgroup float* sg_max, threadgroup float* sg_sum, threadgroup float* sg_acc, int lane, int sg) {
  const int blocks = G / GT;
  const int part = z % NB;
  const int n = z / NB;
  const int bh = n / blocks;
  const int row_begin = part * BR;
  attention_decode_rows<InT, D, GT, SG, R, COALESCED, 1, HP, KV>(
      q, k, v, qk_scale, nullptr, part_max, part_sum, part_acc, Hkv * G, S_cap, bh, bh / Hkv,
      (bh % Hkv) * G + (n % blocks) * GT, row_begin, min(S, row_begin + BR), part, NB, sg_max, sg_sum,
      sg_acc, lane, sg);
}

// Rows per block of a batch row's own context of L rows (attention_decode_block_partials_rows): the smallest power of
// two >= L / target, clamped to [min_rows, max_rows] (both powers of two): the host's fixed_block_rows(L, target,
// min_rows, max_rows), computed here so that no row's length has to reach the host (a sync a step).
inline int attention_row_block_rows(int L, int target, int min_rows, int max_rows) {
  const int want = (L + target - 1) / target;
  int br = min_rows;
  while (br < want && br < max_rows) {
    br *= 2;
  }
  return br;
}

// The merge of the block partials of one (head, slice of 32 * MV elements of D): threadgroup `tg` of MW
// simdgroups (see attention_decode_merge_blocks) over the first nb_used of the head's NB blocks. GATED: the output
// times sigmoid(gate) ([B * Hq, D] InT, the layer's output gate), rounded as stock's separate ops round them
// (attention_decode_merge_live_blocks_gated).
// PM, PS: part_max's and part_sum's pointer types (Metal passes inputs of under 8 elements as `constant`).
template <typename InT, int D, int MV, int MW, int GATED, typename PM, typename PS>
inline void attention_merge_blocks(
    PM part_max, PS part_sum, const device float* part_acc,
    const device InT* gate, device InT* out, int NB, int nb_used, int tg,
    threadgroup float* tg_red, threadgroup float* tg_sum, threadgroup float* tg_acc, int lane, int w) {
  constexpr int UNROLL = 4;
  constexpr int SLICE = 32 * MV;
  const int tid = w * 32 + lane;
  const int slices = D / SLICE;
  const size_t head = static_cast<size_t>(tg / slices);
  const int d0 = (tg % slices) * SLICE;

  float m_all = ATTENTION_NO_MAX;
  for (int b = tid; b < nb_used; b += 32 * MW) {
    m_all = fmax(m_all, part_max[head * NB + b]);
  }
  m_all = simd_max(m_all);
  if (lane == 0) {
    tg_red[w] = m_all;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  m_all = tg_red[0];
  for (int s = 1; s < MW; ++s) {
    m_all = fmax(m_all, tg_red[s]);
  }

  float total = 0.0f;
  float o[MV];
  for (int j = 0; j < MV; ++j) {
    o[j] = 0.0f;
  }
  for (int b0 = w; b0 < nb_used; b0 += UNROLL * MW) {  // uniform over the simdgroup
    uint words[UNROLL][MV];
    float bmax[UNROLL];
    float bsum[UNROLL];
    for (int u = 0; u < UNROLL; ++u) {
      const int b = b0 + u * MW;
      if (b < nb_used) {
        bmax[u] = part_max[head * NB + b];
        bsum[u] = part_sum[head * NB + b];
        AttentionLoad<MV>::load(part_acc + (head * NB + b) * D + d0 + lane * MV, words[u]);
      } else {
        bmax[u] = ATTENTION_NO_MAX;
        bsum[u] = 0.0f;
        for (int j = 0; j < MV; ++j) {
          words[u][j] = 0u;
        }
      }
    }
    for (int u = 0; u < UNROLL; ++u) {
      const float wt = exp(bmax[u] - m_all);
      total += bsum[u] * wt;
      for (int j = 0; j < MV; ++j) {
        o[j] += as_type<float>(words[u][j]) * wt;
      }
    }
  }
  for (int j = 0; j < MV; ++j) {
    tg_acc[w * SLICE + lane * MV + j] = o[j];
  }
  if (lane == 0) {
    tg_sum[w] = total;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int d = tid; d < SLICE; d += 32 * MW) {
    float sum = 0.0f;
    float acc = 0.0f;
    for (int s = 0; s < MW; ++s) {
      sum += tg_sum[s];
      acc += tg_acc[s * SLICE + d];
    }
    const size_t i = head * D + d0 + d;
    const InT o = static_cast<InT>(acc / sum);
    if (GATED) {  // stock's output * sigmoid(gate), each rounded to InT as its two ops round them
      const InT sig = static_cast<InT>(1.0f / (1.0f + exp(-static_cast<float>(gate[i]))));
      out[i] = static_cast<InT>(static_cast<float>(o) * static_cast<float>(sig));
    } else {
      out[i] = o;
    }
  }
}

// The matrix-tile form of the live-length block partials (attention_decode_block_partials_live_tiles, a
// candidate): the G = 8 query heads of a KV head are the 8 rows of a simdgroup_matrix tile, so one simdgroup
// takes 8 K/V rows at a time as products of 8 x 8 tiles (16-bit operands, fp32 accumulators):
//   scores S [8 heads x 8 rows] = sum over D / 8 tiles of Q [8 x 8] K^T [8 x 8]   (D / 8 products)
//   O [8 heads x D] += P [8 x 8] V [8 rows x 8 columns]                            (D / 8 products)
// against the scalar form's 2 G FMAs per K/V element and lane. Each simdgroup is a block of its own (BRM rows,
// partials in the same layout, so attention_decode_merge_live_blocks merges them unchanged); a threadgroup is just
// SG such blocks side by side (no threadgroup barrier). Two passes over a block, so that the output tiles are never
// rescaled (rescaling needs each lane's row in a tile, i.e. a lane layout, which thread_elements() would fix to
// Apple's): pass 1 stores every row's 8 scores into threadgroup memory and the lanes find each head's maximum
// there; the weights p = exp(score * scale - max) are rounded to InT once (the tile operand) and summed as rounded,
// so the output is the weighted mean with the weights the product used (as the prefill kernel); pass 2 adds P V.
// Rows past the live length are never multiplied in: a last chunk of fewer than 8 live rows reads the 8 rows
// ending at the last live row (scores of rows already taken are overwritten with the same rows' scores; their
// weights in that chunk's P tile are 0), and with fewer than 8 live rows in all, V is staged with zeros.
// The bits are this form's own (another summation order than the scalar form's).
#define ATTENTION_TILE_PAD 8  // columns before a block's first row in the score / weight rows (a window's start;
                              // the same count after its last row is spare: no window reaches it)

template <typename InT, int D, int BRM, int STAGED>
struct AttentionTileScratch {
  static constant constexpr int LD = BRM + 2 * ATTENTION_TILE_PAD;                 // score / weight row stride
  static constant constexpr int SCORE_FLOATS = 8 * LD;
  static constant constexpr int SLD = D + 8;                                        // staged row stride (InT)
  static constant constexpr int V_FLOATS = 8 * SLD * sizeof(InT) / 4;              // a zero-filled V chunk
  static constant constexpr int WEIGHTS_AT = SCORE_FLOATS > V_FLOATS ? SCORE_FLOATS : V_FLOATS;
  // 16-byte aligned (the staged rows' vector stores; a simdgroup's scratch starts at a multiple of FLOATS)
  static constant constexpr int STAGE_AT = (WEIGHTS_AT + (8 * LD + 64) * sizeof(InT) / 4 + 3) / 4 * 4;
  static constant constexpr int FLOATS = STAGE_AT + (STAGED ? 8 * SLD * sizeof(InT) / 4 : 0);
};

// STAGED: 8 rows of K or V (from `rows`; those at or past `live` as zeros) copied into threadgroup memory with
// 16-byte loads, adjacent lanes reading adjacent bytes (the 8 rows are 8 D contiguous elements), rows padded by
// 8 elements so that a fragment's 8 rows fall on different banks. Then loaded as tiles from there.
template <typename InT, int D>
inline void attention_stage_rows(const device InT* rows, threadgroup InT* stage, int lane, int live) {
  constexpr int PER = 16 / sizeof(InT);  // elements a 16-byte piece
  for (int i = lane; i < 8 * D / PER; i += 32) {
    const int row = (i * PER) / D;
    const int col = (i * PER) % D;
    attention_u4 piece = attention_u4(0u);
    if (row < live) {
      piece = *reinterpret_cast<const device attention_u4*>(rows + row * D + col);
    }
    *reinterpret_cast<threadgroup attention_u4*>(stage + row * (D + 8) + col) = piece;
  }
}

template <typename InT, int D, int BRM, int STAGED>
inline void attention_decode_block_tiles(
    const device InT* q, const device InT* k, const device InT* v, float scale,
    device float* part_max, device float* part_sum, device float* part_acc,
    int Hkv, int S, int S_cap, int NB, int gb, threadgroup float* scratch, int lane) {
  typedef AttentionTileScratch<InT, D, BRM, STAGED> Scr;
  constexpr int LD = Scr::LD;
  constexpr int SLD = Scr::SLD;
  constexpr int DC = D / 8;
  const int bh = gb / NB;  // b * Hkv + hkv
  const int blk = gb % NB;
  const int r_begin = blk * BRM;
  if (r_begin >= S) {
    return;  // past the live rows: the merge reads only the live blocks (uniform over the simdgroup)
  }
  const int nrows = min(S, r_begin + BRM) - r_begin;
  const int nchunks = (nrows + 7) / 8;
  const int b = bh / Hkv;
  const int hkv = bh % Hkv;
  const int head0 = (b * Hkv + hkv) * 8;  // first query head of the tile, b * Hq + hkv * G
  const device InT* kb = k + size_t(bh) * S_cap * D;
  const device InT* vb = v + size_t(bh) * S_cap * D;
  threadgroup float* sc = scratch;  // [8][LD] scores (fp32), later a zero-filled V chunk
  threadgroup InT* pw = reinterpret_cast<threadgroup InT*>(scratch + Scr::WEIGHTS_AT);
  threadgroup InT* pwin = pw + 8 * LD;  // [8][8]: the weights of a last, partial chunk's window
  threadgroup InT* stage = reinterpret_cast<threadgroup InT*>(scratch + Scr::STAGE_AT);  // [8][SLD] if STAGED

  simdgroup_matrix<InT, 8, 8> qf[DC];  // (head, d) = q[head0 + head][8 dc + d]
  #pragma unroll
  for (int dc = 0; dc < DC; ++dc) {
    simdgroup_load(qf[dc], q + size_t(head0) * D + dc * 8, D);
  }
  // Pass 1: scores of every row of the block, column ATTENTION_TILE_PAD + (row - r_begin).
  for (int c = 0; c < nchunks; ++c) {
    const int r = r_begin + 8 * c;
    const int w = r + 8 <= S ? r : max(S - 8, 0);  // the 8 rows read: the chunk, or the 8 ending at S - 1
    simdgroup_matrix<float, 8, 8> s = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    if (STAGED) {
      attention_stage_rows<InT, D>(kb + size_t(w) * D, stage, lane, 8);  // rows past S: their own columns only
      simdgroup_barrier(mem_flags::mem_threadgroup);
    }
    #pragma unroll
    for (int dc = 0; dc < DC; ++dc) {
      simdgroup_matrix<InT, 8, 8> kf;  // (d, row) = K[w + row][8 dc + d]
      if (STAGED) {
        simdgroup_load(kf, stage + dc * 8, SLD, ulong2(0, 0), true);
      } else {
        simdgroup_load(kf, kb + size_t(w) * D + dc * 8, D, ulong2(0, 0), true);
      }
      simdgroup_multiply_accumulate(s, qf[dc], kf, s);
    }
    simdgroup_store(s, sc + ATTENTION_TILE_PAD + (w - r_begin), LD);
    if (STAGED) {
      simdgroup_barrier(mem_flags::mem_threadgroup);  // every lane done with the staged rows
    }
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  // Each head's maximum and weights: lane l takes head l / 4, rows l % 4, l % 4 + 4, ...
  const int h = lane / 4;
  float m = ATTENTION_NO_MAX;
  for (int i = lane % 4; i < nrows; i += 4) {
    m = fmax(m, sc[h * LD + ATTENTION_TILE_PAD + i] * scale);
  }
  m = fmax(m, simd_shuffle_xor(m, 1));
  m = fmax(m, simd_shuffle_xor(m, 2));
  float total = 0.0f;
  for (int i = lane % 4; i < LD; i += 4) {  // every column: zeros outside the live rows (the windows read them)
    const int row = i - ATTENTION_TILE_PAD;
    InT p = InT(0.0f);
    if (row >= 0 && row < nrows) {
      p = static_cast<InT>(exp(sc[h * LD + i] * scale - m));
      total += static_cast<float>(p);
    }
    pw[h * LD + i] = p;
  }
  total += simd_shuffle_xor(total, 1);
  total += simd_shuffle_xor(total, 2);
  simdgroup_barrier(mem_flags::mem_threadgroup);
  // Pass 2: O += P V, chunk by chunk.
  simdgroup_matrix<float, 8, 8> of[DC];
  #pragma unroll
  for (int dc = 0; dc < DC; ++dc) {
    of[dc] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  for (int c = 0; c < nchunks; ++c) {
    const int r = r_begin + 8 * c;
    simdgroup_matrix<InT, 8, 8> pf;  // (head, row)
    const device InT* vsrc;
    const threadgroup InT* vstage = nullptr;
    int vld = D;
    if (r + 8 <= S) {
      simdgroup_load(pf, pw + ATTENTION_TILE_PAD + 8 * c, LD);
      vsrc = vb + size_t(r) * D;
      if (STAGED) {
        attention_stage_rows<InT, D>(vsrc, stage, lane, 8);
        simdgroup_barrier(mem_flags::mem_threadgroup);
        vstage = stage;
        vld = SLD;
      }
    } else {
      // The last, partial chunk: rows w .. w + 7 with weight 0 for the rows before r (taken already) and past S.
      const int w = max(S - 8, 0);
      for (int e = lane; e < 64; e += 32) {
        const int row = w + e % 8;
        pwin[e] = row >= r && row < S ? pw[(e / 8) * LD + ATTENTION_TILE_PAD + (row - r_begin)] : InT(0.0f);
      }
      vsrc = vb + size_t(w) * D;
      if (STAGED || S < 8) {  // (unstaged, S < 8: rows S .. 7 are not live and may hold anything) rows S .. as zeros
        threadgroup InT* to = STAGED ? stage : reinterpret_cast<threadgroup InT*>(sc);  // scores no longer needed
        attention_stage_rows<InT, D>(vsrc, to, lane, S - w);
        vstage = to;
        vld = SLD;
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);
      simdgroup_load(pf, pwin, 8);
    }
    #pragma unroll
    for (int dc = 0; dc < DC; ++dc) {
      simdgroup_matrix<InT, 8, 8> vf;  // (row, d) = V[w + row][8 dc + d]
      if (vstage != nullptr) {
        simdgroup_load(vf, vstage + dc * 8, vld);
      } else {
        simdgroup_load(vf, vsrc + dc * 8, D);
      }
      simdgroup_multiply_accumulate(of[dc], pf, vf, of[dc]);
    }
    if (STAGED) {
      simdgroup_barrier(mem_flags::mem_threadgroup);  // every lane done with the staged rows
    }
  }
  // The block's partials: rows of the output tiles are the 8 heads (stride NB * D in part_acc).
  #pragma unroll
  for (int dc = 0; dc < DC; ++dc) {
    simdgroup_store(of[dc], part_acc + (size_t(head0) * NB + blk) * D + dc * 8, ulong(NB) * D);
  }
  if (lane % 4 == 0) {
    part_max[size_t(head0 + h) * NB + blk] = m;
    part_sum[size_t(head0 + h) * NB + blk] = total;
  }
}

// @kernel attention_decode
// q: [B, Hq, 1, D] InT; k, v: [B, Hkv, S_cap, D] InT (rows < S read); scale: [1] fp32; row_start:
// [B] int32 (if has_row_start: row b's keys are rows row_start[b] .. S - 1, its left padding skipped,
// as mlx_lm's BatchKVCache; the simdgroups' row steps count from there, so a row's bits are those of
// the same sequence alone). out: [B, Hq, 1, D] InT. Grid (32, SG, B * Hkv * G / GT), threadgroup
// (32, SG, 1). params: named in the launcher's KernelSpec (a generated prologue declares them).
{
  constexpr int HP = ATTENTION_MERGE_HEADS(GT, SG, D);
  threadgroup float sg_max[GT * SG];
  threadgroup float sg_sum[GT * SG];
  threadgroup float sg_acc[SG * HP * D];
  const int blocks = G / GT;  // threadgroups per KV head
  const int n = static_cast<int>(thread_position_in_grid.z);
  const int bh = n / blocks;  // b * Hkv + hkv
  const int begin = has_row_start != 0 ? static_cast<int>(row_start[bh / Hkv]) : 0;
  const AttentionPlainRows<InT, D, COALESCED> k_rows = {k};
  const AttentionPlainRows<InT, D, COALESCED> v_rows = {v};
  attention_decode_rows<InT, D, GT, SG, R, COALESCED, 0, HP>(
      q, k_rows, v_rows, scale[0], out, nullptr, nullptr, nullptr, Hkv * G, S_cap, bh, bh / Hkv,
      (bh % Hkv) * G + (n % blocks) * GT, begin, S, 0, 1, sg_max, sg_sum, sg_acc,
      static_cast<int>(thread_index_in_simdgroup), static_cast<int>(thread_position_in_threadgroup.y));
}

// @kernel attention_decode_block_partials
// The fixed-block split (fixed_block_attention): KV rows cut into NB = ceil(S / BR) blocks of BR
// rows, one threadgroup per (block, GT heads): grid (32 * NB * B * Hkv * G / GT, SG, 1) (blocks in
// x: CUDA limits y and z to 65535), threadgroup (32, SG, 1); threadgroup x = n * NB + block, so
// consecutive threadgroups stream consecutive blocks of one KV head. Same inputs as attention_decode;
// outputs the blocks' fp32 partials part_max, part_sum [B * Hq, NB] and part_acc [B * Hq, NB, D]
// (attention_decode_rows), merged by the next kernel. A row's blocks depend only on its own S and
// BR (the host picks BR from S alone), never on the batch.
{
  constexpr int HP = ATTENTION_MERGE_HEADS(GT, SG, D);
  threadgroup float sg_max[GT * SG];
  threadgroup float sg_sum[GT * SG];
  threadgroup float sg_acc[SG * HP * D];
  const AttentionPlainRows<InT, D, COALESCED> k_rows = {k};
  const AttentionPlainRows<InT, D, COALESCED> v_rows = {v};
  attention_decode_block<InT, D, GT, SG, R, COALESCED, HP>(
      q, k_rows, v_rows, scale[0], part_max, part_sum, part_acc, Hkv, G, S, S_cap, NB, BR,
      static_cast<int>(threadgroup_position_in_grid.x), sg_max, sg_sum, sg_acc,
      static_cast<int>(thread_index_in_simdgroup), static_cast<int>(thread_position_in_threadgroup.y));
}

// @kernel attention_decode_block_partials_live
// The same blocks over a KV buffer whose live length is an input, not a parameter (switch
// kv_write_in_trace: one trace serves every step until the buffer grows): the live rows are
// 0 .. last_row[0] (the row this step wrote); NB = ceil(S_cap / BR) blocks of BR rows cover the whole
// capacity (the host picks BR from S_cap alone); the threadgroups of blocks past the live rows leave at once,
// writing nothing (attention_decode_merge_live_blocks reads only the live blocks).
// last_row: [1] int32. Otherwise as attention_decode_block_partials.
{
  constexpr int HP = ATTENTION_MERGE_HEADS(GT, SG, D);
  threadgroup float sg_max[GT * SG];
  threadgroup float sg_sum[GT * SG];
  threadgroup float sg_acc[SG * HP * D];
  const int S = min(S_cap, static_cast<int>(last_row[0]) + 1);
  if ((static_cast<int>(threadgroup_position_in_grid.x) % NB) * BR >= S) {
    return;  // a block past the live rows: nothing to write, the merge reads only the live blocks (uniform exit)
  }
  const AttentionPlainRows<InT, D, COALESCED> k_rows = {k};
  const AttentionPlainRows<InT, D, COALESCED> v_rows = {v};
  attention_decode_block<InT, D, GT, SG, R, COALESCED, HP>(
      q, k_rows, v_rows, scale[0], part_max, part_sum, part_acc, Hkv, G, S, S_cap, NB, BR,
      static_cast<int>(threadgroup_position_in_grid.x), sg_max, sg_sum, sg_acc,
      static_cast<int>(thread_index_in_simdgroup), static_cast<int>(thread_position_in_threadgroup.y));
}

// @kernel attention_decode_block_partials_rows
// The fixed-block split over a batch's rows (mlx_lm's BatchKVCache, the server's batches): row b's keys are rows
// row_start[b] .. S - 1 (its left padding skipped), cut into blocks counted from row_start[b] of its own BR_b =
// attention_row_block_rows(S - row_start[b], TARGET, MIN_ROWS, MAX_ROWS) rows. So a row's blocks, and its bits, are
// those of the same sequence alone in attention_decode_block_partials with BR = fixed_block_rows(its length, TARGET):
// they never depend on the other rows. NB: the most blocks a row of at most S rows can have (the partials' stride);
// the threadgroups of a row's blocks past its own count leave at once, writing nothing
// (attention_decode_merge_row_blocks reads each row's own blocks). row_start: [B] int32. Otherwise (grid, inputs,
// outputs) as attention_decode_block_partials.
{
  constexpr int HP = ATTENTION_MERGE_HEADS(GT, SG, D);
  threadgroup float sg_max[GT * SG];
  threadgroup float sg_sum[GT * SG];
  threadgroup float sg_acc[SG * HP * D];
  const int z = static_cast<int>(threadgroup_position_in_grid.x);
  const int part = z % NB;
  const int n = z / NB;
  const int bh = n / (G / GT);
  const int begin = static_cast<int>(row_start[bh / Hkv]);
  const int br = attention_row_block_rows(S - begin, TARGET, MIN_ROWS, MAX_ROWS);
  const int row_begin = begin + part * br;
  if (row_begin >= S) {
    return;  // past the row's own blocks (uniform exit)
  }
  const AttentionPlainRows<InT, D, COALESCED> k_rows = {k};
  const AttentionPlainRows<InT, D, COALESCED> v_rows = {v};
  attention_decode_rows<InT, D, GT, SG, R, COALESCED, 1, HP>(
      q, k_rows, v_rows, scale[0], nullptr, part_max, part_sum, part_acc, Hkv * G, S_cap, bh, bh / Hkv,
      (bh % Hkv) * G + (n % (G / GT)) * GT, row_begin, min(S, row_begin + br), part, NB, sg_max, sg_sum, sg_acc,
      static_cast<int>(thread_index_in_simdgroup), static_cast<int>(thread_position_in_threadgroup.y));
}

// @kernel attention_decode_quantized
// attention_decode over an MLX-LM QuantizedKVCache, dequantised as the rows are read (AttentionQuantizedRows;
// BITS and GROUP template arguments besides attention_decode's): k, v: packed [B, Hkv, S_cap, D * BITS / 32]
// uint32; k_scales, k_biases, v_scales, v_biases: [B, Hkv, S_cap, D / GROUP] InT; rows < S read. The lanes own
// contiguous elements, so COALESCED (which only sets how q is read and the merge's element order) must give that
// ownership: the host passes 1 where W == EPL (16-bit types), else 0. Otherwise as attention_decode (no row_start:
// MLX-LM has no batched quantized cache).
{
  static_assert(!COALESCED || AttentionShape<InT, D, GT, R>::W == D / 32, "contiguous elements a lane");
  constexpr int HP = ATTENTION_MERGE_HEADS(GT, SG, D);
  threadgroup float sg_max[GT * SG];
  threadgroup float sg_sum[GT * SG];
  threadgroup float sg_acc[SG * HP * D];
  typedef AttentionQuantizedRows<InT, D, BITS, GROUP, decltype(k), decltype(k_scales)> Rows;  // v's types are k's
  const Rows k_rows = {k, k_scales, k_biases};
  const Rows v_rows = {v, v_scales, v_biases};
  const int blocks = G / GT;
  const int n = static_cast<int>(thread_position_in_grid.z);
  const int bh = n / blocks;
  attention_decode_rows<InT, D, GT, SG, R, COALESCED, 0, HP>(
      q, k_rows, v_rows, scale[0], out, nullptr, nullptr, nullptr, Hkv * G, S_cap, bh, bh / Hkv,
      (bh % Hkv) * G + (n % blocks) * GT, 0, S, 0, 1, sg_max, sg_sum, sg_acc,
      static_cast<int>(thread_index_in_simdgroup), static_cast<int>(thread_position_in_threadgroup.y));
}

// @kernel attention_decode_block_partials_quantized
// attention_decode_block_partials over a QuantizedKVCache: inputs as attention_decode_quantized, params and outputs
// as attention_decode_block_partials (merged by attention_decode_merge_blocks).
{
  static_assert(!COALESCED || AttentionShape<InT, D, GT, R>::W == D / 32, "contiguous elements a lane");
  constexpr int HP = ATTENTION_MERGE_HEADS(GT, SG, D);
  threadgroup float sg_max[GT * SG];
  threadgroup float sg_sum[GT * SG];
  threadgroup float sg_acc[SG * HP * D];
  typedef AttentionQuantizedRows<InT, D, BITS, GROUP, decltype(k), decltype(k_scales)> Rows;  // v's types are k's
  const Rows k_rows = {k, k_scales, k_biases};
  const Rows v_rows = {v, v_scales, v_biases};
  attention_decode_block<InT, D, GT, SG, R, COALESCED, HP>(
      q, k_rows, v_rows, scale[0], part_max, part_sum, part_acc, Hkv, G, S, S_cap, NB, BR,
      static_cast<int>(threadgroup_position_in_grid.x), sg_max, sg_sum, sg_acc,
      static_cast<int>(thread_index_in_simdgroup), static_cast<int>(thread_position_in_threadgroup.y));
}

// @kernel attention_decode_block_partials_live_quantized
// attention_decode_block_partials_live over a QuantizedKVCache's whole buffers (kv_write_in_trace with --kv-bits:
// the step's row quantised and written inside the layer's trace): inputs as attention_decode_quantized plus
// last_row, params and outputs as attention_decode_block_partials_live (merged by attention_decode_merge_live_blocks
// or its gated form).
{
  static_assert(!COALESCED || AttentionShape<InT, D, GT, R>::W == D / 32, "contiguous elements a lane");
  constexpr int HP = ATTENTION_MERGE_HEADS(GT, SG, D);
  threadgroup float sg_max[GT * SG];
  threadgroup float sg_sum[GT * SG];
  threadgroup float sg_acc[SG * HP * D];
  const int S = min(S_cap, static_cast<int>(last_row[0]) + 1);
  if ((static_cast<int>(threadgroup_position_in_grid.x) % NB) * BR >= S) {
    return;  // a block past the live rows (uniform exit), as in attention_decode_block_partials_live
  }
  typedef AttentionQuantizedRows<InT, D, BITS, GROUP, decltype(k), decltype(k_scales)> Rows;  // v's types are k's
  const Rows k_rows = {k, k_scales, k_biases};
  const Rows v_rows = {v, v_scales, v_biases};
  attention_decode_block<InT, D, GT, SG, R, COALESCED, HP>(
      q, k_rows, v_rows, scale[0], part_max, part_sum, part_acc, Hkv, G, S, S_cap, NB, BR,
      static_cast<int>(threadgroup_position_in_grid.x), sg_max, sg_sum, sg_acc,
      static_cast<int>(thread_index_in_simdgroup), static_cast<int>(thread_position_in_threadgroup.y));
}

// @kernel attention_decode_block_partials_live_tiles
// The live-length block partials as matrix tiles (attention_decode_block_tiles; a candidate, G = 8 only): block
// gb = threadgroup x * SG + simdgroup covers rows (gb % NB) * BRM .. + BRM of KV head gb / NB; grid
// (32 * ceil(B * Hkv * NB / SG), SG, 1), threadgroup (32, SG, 1). Inputs, params and outputs as
// attention_decode_block_partials_live with BR = BRM (template, with InT, D, SG, STAGED: K and V rows through
// threadgroup memory with 16-byte loads, or tiles loaded from device memory); params B, Hkv, S_cap, NB.
{
  typedef AttentionTileScratch<InT, D, BRM, STAGED> Scr;
  threadgroup float4 scratch4[SG * Scr::FLOATS / 4];  // float4: 16-byte aligned for the staged rows' stores
  threadgroup float* scratch = reinterpret_cast<threadgroup float*>(scratch4);
  const int sg = static_cast<int>(thread_position_in_threadgroup.y);
  const int gb = static_cast<int>(threadgroup_position_in_grid.x) * SG + sg;
  if (gb >= B * Hkv * NB) {
    return;  // a slot past the last block (uniform over the simdgroup)
  }
  const int S = min(S_cap, static_cast<int>(last_row[0]) + 1);
  attention_decode_block_tiles<InT, D, BRM, STAGED>(
      q, k, v, scale[0], part_max, part_sum, part_acc, Hkv, S, S_cap, NB, gb, scratch + sg * Scr::FLOATS,
      static_cast<int>(thread_index_in_simdgroup));
}

// @kernel attention_decode_merge_blocks
// out[head, d] = sum_b exp(max_b - M) acc_b[d] / sum_b exp(max_b - M) sum_b, M = max_b max_b, over
// the NB block partials of each head. One threadgroup of MW simdgroups per (head, slice of 32 * MV
// elements of D): grid (32 * B * Hq * D / (32 * MV), MW, 1), threadgroup (32, MW, 1). The
// threadgroup first finds M (all threads over the block maxima); then simdgroup w takes blocks
// w, w + MW, ... (UNROLL blocks' loads in flight at once), each lane MV consecutive fp32 of the
// slice in one 8/16-byte load; the MW partial sums are added in simdgroup order through threadgroup
// memory. Fixed order for a given NB: deterministic. out: [B, Hq, 1, D] InT.
{
  threadgroup float tg_red[MW];
  threadgroup float tg_sum[MW];
  threadgroup float tg_acc[MW * 32 * MV];
  attention_merge_blocks<InT, D, MV, MW, 0>(
      part_max, part_sum, part_acc, nullptr, out, NB, NB, static_cast<int>(threadgroup_position_in_grid.x),
      tg_red, tg_sum, tg_acc, static_cast<int>(thread_index_in_simdgroup),
      static_cast<int>(thread_position_in_threadgroup.y));
}

// @kernel attention_decode_merge_live_blocks
// attention_decode_merge_blocks over the live-length form's partials: only the blocks that hold live rows,
// ceil((last_row[0] + 1) / BR) of the NB (the others were left unwritten). last_row: [1] int32.
{
  threadgroup float tg_red[MW];
  threadgroup float tg_sum[MW];
  threadgroup float tg_acc[MW * 32 * MV];
  const int used = min(NB, (static_cast<int>(last_row[0]) + BR) / BR);
  attention_merge_blocks<InT, D, MV, MW, 0>(
      part_max, part_sum, part_acc, nullptr, out, NB, used, static_cast<int>(threadgroup_position_in_grid.x),
      tg_red, tg_sum, tg_acc, static_cast<int>(thread_index_in_simdgroup),
      static_cast<int>(thread_position_in_threadgroup.y));
}

// @kernel attention_decode_merge_row_blocks
// attention_decode_merge_blocks over attention_decode_block_partials_rows' partials: each row's own blocks,
// ceil(L_b / BR_b) of the NB (L_b = S - row_start[b], BR_b its schedule as there). row_start: [B] int32; params Hq,
// S, TARGET, MIN_ROWS, MAX_ROWS besides NB.
{
  threadgroup float tg_red[MW];
  threadgroup float tg_sum[MW];
  threadgroup float tg_acc[MW * 32 * MV];
  const int tg = static_cast<int>(threadgroup_position_in_grid.x);
  const int head = tg / (D / (32 * MV));
  const int length = S - static_cast<int>(row_start[head / Hq]);
  const int br = attention_row_block_rows(length, TARGET, MIN_ROWS, MAX_ROWS);
  attention_merge_blocks<InT, D, MV, MW, 0>(
      part_max, part_sum, part_acc, nullptr, out, NB, (length + br - 1) / br, tg, tg_red, tg_sum, tg_acc,
      static_cast<int>(thread_index_in_simdgroup), static_cast<int>(thread_position_in_threadgroup.y));
}

// @kernel attention_decode_merge_live_blocks_gated
// attention_decode_merge_live_blocks with the attention layer's output gate applied (switch fused_output_gate):
// out = merged * sigmoid(gate), gate: [B, 1, Hq * D] InT (the q/k preparation's gate output).
{
  threadgroup float tg_red[MW];
  threadgroup float tg_sum[MW];
  threadgroup float tg_acc[MW * 32 * MV];
  const int used = min(NB, (static_cast<int>(last_row[0]) + BR) / BR);
  attention_merge_blocks<InT, D, MV, MW, 1>(
      part_max, part_sum, part_acc, gate, out, NB, used, static_cast<int>(threadgroup_position_in_grid.x),
      tg_red, tg_sum, tg_acc, static_cast<int>(thread_index_in_simdgroup),
      static_cast<int>(thread_position_in_threadgroup.y));
}
