// MoE routing bookkeeping for one prefill chunk (lily_mlx/ops/moe/kernels.py dispatches these).
// All integer results are exact and deterministic (no atomics); no host synchronisation needed.
//   moe_route_histogram_i32   per chunk of CHUNK assignments: rows per expert, and each assignment's
//                             rank among the chunk's earlier assignments to the same expert
//   moe_route_scan_i32        per-expert totals, exclusive prefix scan -> offsets, per-chunk offsets
//   moe_route_scatter_i32     slot of every assignment (expert-contiguous, stable) and its inverse
//   moe_route_block_map_i32   the (expert, first slot, rows, tile rows) blocks the GEMMs process

// @header
// (no shared helpers)

// @kernel moe_route_histogram_i32
// grid (n_chunks * CHUNK, 1, 1), threadgroup (CHUNK, 1, 1). params: [A, E, n_chunks].
// inds [A] expert ids; chunk_counts [n_chunks, E]: rows per expert in each chunk;
// local_rank [A]: assignments to the same expert earlier in the same chunk.
threadgroup int chunk_experts[CHUNK];
const uint t = thread_position_in_threadgroup.x;
const int chunk = int(threadgroup_position_in_grid.x);
const int a = chunk * CHUNK + int(t);
const int e = a < A ? int(inds[a]) : -1;
chunk_experts[t] = e;
threadgroup_barrier(mem_flags::mem_threadgroup);
if (a < A) {
  int before = 0;
  for (int j = 0; j < int(t); ++j) {
    before += chunk_experts[j] == e ? 1 : 0;
  }
  local_rank[a] = before;
}
for (int ex = int(t); ex < E; ex += CHUNK) {
  int n = 0;
  for (int j = 0; j < CHUNK; ++j) {
    n += chunk_experts[j] == ex ? 1 : 0;
  }
  chunk_counts[chunk * E + ex] = n;
}

// @kernel moe_route_scan_i32
// grid (NT, 1, 1), threadgroup (NT, 1, 1), NT >= E a multiple of 32, <= 1024. params: [A, E, n_chunks].
// counts [E] rows per expert; offsets [E + 1] exclusive prefix sum (offsets[E] = A);
// chunk_offsets [n_chunks, E] first slot of each chunk's rows of each expert.
threadgroup int scan[NT];
const int t = int(thread_position_in_threadgroup.x);
int total = 0;
if (t < E) {
  for (int c = 0; c < n_chunks; ++c) {
    total += chunk_counts[c * E + t];
  }
}
// Inclusive Hillis-Steele scan over the threadgroup.
scan[t] = total;
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int step = 1; step < NT; step <<= 1) {
  int v = t >= step ? scan[t - step] : 0;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  scan[t] += v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
if (t < E) {
  int running = scan[t] - total;
  counts[t] = total;
  offsets[t] = running;
  for (int c = 0; c < n_chunks; ++c) {
    chunk_offsets[c * E + t] = running;
    running += chunk_counts[c * E + t];
  }
}
if (t == 0) {
  offsets[E] = scan[NT - 1];
}

// @kernel moe_route_scatter_i32
// grid (n_chunks * CHUNK, 1, 1), threadgroup (CHUNK, 1, 1). params: [A, E, n_chunks].
// sorted_rows [A]: slot -> assignment; slot_of_row [A]: assignment -> slot (the inverse map).
const int a = int(thread_position_in_grid.x);
if (a < A) {
  const int chunk = a / CHUNK;
  const int slot = chunk_offsets[chunk * E + int(inds[a])] + local_rank[a];
  sorted_rows[slot] = a;
  slot_of_row[a] = slot;
}

// @kernel moe_route_block_map_i32
// grid (NT, 1, 1), threadgroup (NT, 1, 1), NT >= E a multiple of 32, <= 1024.
// params: named in the launcher's KernelSpec (a generated prologue declares them). Experts with >= large_min_rows rows get 32-row tiles,
// the others 16-row tiles. blocks [max_blocks, 4]: (expert, first slot, rows, tile rows) in expert
// order; entries past the last block are (-1, 0, 0, 0).
threadgroup int scan[NT];
const int t = int(thread_position_in_threadgroup.x);
const int n = t < E ? counts[t] : 0;
const int tile = n >= large_min_rows ? 32 : 16;
const int n_tiles = (n + tile - 1) / tile;
scan[t] = n_tiles;
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int step = 1; step < NT; step <<= 1) {
  int v = t >= step ? scan[t - step] : 0;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  scan[t] += v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
const int total_blocks = scan[NT - 1];
int b = scan[t] - n_tiles;
for (int i = 0; i < n_tiles; ++i, ++b) {
  blocks[4 * b + 0] = t;
  blocks[4 * b + 1] = offsets[t] + i * tile;
  blocks[4 * b + 2] = min(tile, n - i * tile);
  blocks[4 * b + 3] = tile;
}
for (int j = total_blocks + t; j < max_blocks; j += NT) {
  blocks[4 * j + 0] = -1;
  blocks[4 * j + 1] = 0;
  blocks[4 * j + 2] = 0;
  blocks[4 * j + 3] = 0;
}
