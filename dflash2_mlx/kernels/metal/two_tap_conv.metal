// Two-tap grouped dynamic convolution, local to each block (body for mx.fast.metal_kernel).
// Specification: reference_two_tap_conv in dflash2_mlx/kernels/reference.py.
//
//   out[n, t, c] = (base[0, c] + dyn[n, t, 0, g]) * x[n, t, c]
//                + (base[1, c] + dyn[n, t, 1, g]) * x[n, t - 1, c],   g = c / (H / G),
//   with x[n, -1, c] = 0 (the convolution never crosses a block boundary).
//
// Inputs : x [N, L, H] (template type T), dyn [N, L, 2, G], base [2, H] (any float dtype).
// Output : out [N, L, H] (T). Arithmetic is float32; the result is rounded to T once.
// Grid   : (H, N, 1). One thread per (block, channel) walks the block's L rows, so x[t - 1]
//          stays in a register. Threads are independent: no threadgroup memory, no barriers.
const uint c = thread_position_in_grid.x;
const uint n = thread_position_in_grid.y;
const int L = x_shape[1];
const int H = x_shape[2];
const int G = dyn_shape[3];
if (c >= uint(H) || n >= uint(x_shape[0])) {
  return;
}
const size_t g = size_t(c) / size_t(H / G);
const float b0 = static_cast<float>(base[c]);
const float b1 = static_cast<float>(base[size_t(H) + c]);
float prev = 0.0f;
for (int t = 0; t < L; ++t) {
  const size_t row = size_t(n) * size_t(L) + size_t(t);
  const size_t xi = row * size_t(H) + size_t(c);
  const size_t di = row * size_t(2 * G) + g;
  const float cur = static_cast<float>(x[xi]);
  const float k0 = b0 + static_cast<float>(dyn[di]);
  const float k1 = b1 + static_cast<float>(dyn[di + size_t(G)]);
  out[xi] = static_cast<T>(k0 * cur + k1 * prev);
  prev = cur;
}
