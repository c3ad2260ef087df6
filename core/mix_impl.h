/*
 * SplitMix64's finaliser and step: the bijective 64-bit mix behind the counter-based parameter
 * init (nn/init.c) and the shuffled data order (train/data.c).
 */
#ifndef FSDPC_BASE_MIX_H
#define FSDPC_BASE_MIX_H

#include <stdint.h>

/* SplitMix64's finaliser: a bijection of 64-bit words that mixes every bit into every bit. */
static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* SplitMix64's output for state z: the state advanced by the golden increment, mixed. */
static inline uint64_t splitmix64(uint64_t z) { return mix64(z + 0x9e3779b97f4a7c15ull); }

#endif
