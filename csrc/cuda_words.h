// The load/store word types of the CUDA copy kernels: KvpWord<VEC>::T is VEC bytes.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

template <int VEC>
struct KvpWord;
template <>
struct KvpWord<16> { using T = uint4; };
template <>
struct KvpWord<8> { using T = uint2; };
template <>
struct KvpWord<4> { using T = uint32_t; };
template <>
struct KvpWord<2> { using T = uint16_t; };
template <>
struct KvpWord<1> { using T = uint8_t; };
