// Candidate selector: pair scores and the path walk in one dispatch (body for mx.fast.metal_kernel).
// Specification: reference_select_greedy in dflash2_mlx/kernels/reference.py.
//
// Inputs : anchor [N] int32, candidates [N, R, K] int32, unary [N, R, K], hidden [N, R, D],
//          pred_cb [V, D], succ_cb [V, D] (float dtypes, read as float32).
// Outputs: path [N, R] int32; scores [N, R, K, K] float32, scratch: scores[n, i, a, b] is the
//          score of candidate b of row i after candidate a of row i - 1 (row 0 has one
//          predecessor, the anchor, at a = 0; scores[n, 0, a > 0, :] is never written).
// Grid   : (TPG, N, 1) with threadgroup (TPG, 1, 1): one threadgroup per block n.
//   Phase 1 (all threads): every pair score of the block, each work item a disjoint output.
//   threadgroup_barrier(mem_device): the scores written by the group are visible to the group.
//   Phase 2 (thread 0): the sequential walk over the R rows, starting from the anchor.
const uint n = threadgroup_position_in_grid.y;
const uint tid = thread_position_in_threadgroup.x;
const uint tpg = threads_per_threadgroup.x;
const int R = candidates_shape[1];
const int K = candidates_shape[2];
const int D = hidden_shape[2];
const size_t nr = size_t(n) * size_t(R);

// Phase 1. Work item w: w < K -> row 0 (predecessor: the anchor), candidate b = w;
// otherwise v = w - K: row i = 1 + v / (K * K), predecessor a = (v / K) % K, candidate b = v % K.
const uint items = uint(K) + uint(R - 1) * uint(K) * uint(K);
for (uint w = tid; w < items; w += tpg) {
  int i = 0;
  int a = 0;
  int b = int(w);
  int prev_token = anchor[n];
  if (w >= uint(K)) {
    const uint v = w - uint(K);
    i = 1 + int(v / uint(K * K));
    a = int((v / uint(K)) % uint(K));
    b = int(v % uint(K));
    prev_token = candidates[(nr + size_t(i - 1)) * size_t(K) + size_t(a)];
  }
  const size_t cell = (nr + size_t(i)) * size_t(K) + size_t(b);
  const int token = candidates[cell];
  const size_t p0 = size_t(prev_token) * size_t(D);
  const size_t s0 = size_t(token) * size_t(D);
  const size_t h0 = (nr + size_t(i)) * size_t(D);
  float acc = 0.0f;
  for (int d = 0; d < D; ++d) {
    const float left = static_cast<float>(pred_cb[p0 + d]) * static_cast<float>(hidden[h0 + d]);
    acc += left * static_cast<float>(succ_cb[s0 + d]);
  }
  scores[((nr + size_t(i)) * size_t(K) + size_t(a)) * size_t(K) + size_t(b)] =
      static_cast<float>(unary[cell]) + acc;
}

threadgroup_barrier(mem_flags::mem_device);

// Phase 2: thread 0 walks the rows; a is the chosen candidate index of the previous row.
if (tid == 0) {
  int a = 0;
  for (int i = 0; i < R; ++i) {
    const size_t srow = ((nr + size_t(i)) * size_t(K) + size_t(a)) * size_t(K);
    int choice = 0;
    // First maximum (lowest index), as mx.argmax.
    float best = scores[srow];
    for (int b = 1; b < K; ++b) {
      const float s = scores[srow + b];
      if (s > best) {
        best = s;
        choice = b;
      }
    }
    path[nr + size_t(i)] = candidates[(nr + size_t(i)) * size_t(K) + size_t(choice)];
    a = choice;
  }
}
