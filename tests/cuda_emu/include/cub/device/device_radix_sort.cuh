/* cub's radix sort of pairs for the emulator: a stable sort on the host over bits
 * [begin_bit, end_bit) of the keys. */
#pragma once
#include <algorithm>
#include <numeric>
#include <vector>
namespace cub {
struct DeviceRadixSort {
  template <typename K, typename V>
  static cudaError_t SortPairs(void *temp, size_t &temp_bytes, const K *keys_in, K *keys_out,
                               const V *values_in, V *values_out, int n, int begin_bit = 0,
                               int end_bit = sizeof(K) * 8, cudaStream_t = 0) {
    if (temp == NULL) {
      temp_bytes = 256;
      return cudaSuccess;
    }
    std::vector<int> order(n);
    std::iota(order.begin(), order.end(), 0);
    auto bits = [&](K k) {
      unsigned long long u = (unsigned long long)k >> begin_bit;
      int w = end_bit - begin_bit;
      return w >= 64 ? u : u & ((1ull << w) - 1);
    };
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return bits(keys_in[a]) < bits(keys_in[b]); });
    std::vector<K> k(n);
    std::vector<V> v(n);
    for (int i = 0; i < n; i++) {
      k[i] = keys_in[order[i]];
      v[i] = values_in[order[i]];
    }
    std::copy(k.begin(), k.end(), keys_out);
    std::copy(v.begin(), v.end(), values_out);
    return cudaSuccess;
  }
};
}  // namespace cub
