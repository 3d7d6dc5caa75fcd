// The argument checks the ops share (plans.cpp, chunked_gemm.cpp, the backends' messages).
// Each raises (TORCH_CHECK) with a message naming the op and the argument.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace mti {

// Integers and shapes as text for error messages. TORCH_CHECK would stream them through
// std::ostream's integer insertion, which crashes inside extensions built against some torch
// wheels (seen with torch 2.11 and GCC 13: a segfault in ostream::_M_insert<long> while
// formatting the message), so the messages pass text only.
std::string text(int64_t v);
std::string text(at::IntArrayRef shape);

// t is float32, float16, bfloat16 or float64.
void check_float_dtype(const char* op, const char* name, const at::Tensor& t);

// t has the device and dtype of x (called `x_name` in the message; check_like_x: "x").
void check_like(const char* op, const char* name, const at::Tensor& t, const char* x_name,
                const at::Tensor& x);
void check_like_x(const char* op, const char* name, const at::Tensor& x, const at::Tensor& t);

// x (called `x_name`) is written while `other` is read: refuse any sharing of memory,
// including x being a view into other. Conservative: two interleaved but disjoint views of one
// storage are refused too.
void check_no_overlap(const char* op, const char* name, const at::Tensor& x,
                      const at::Tensor& other, const char* x_name = "x");

// Refuses x whose elements share memory (an expanded or as_strided view): writing one
// element would change another.
void check_no_internal_overlap(const char* op, const at::Tensor& x, const char* x_name = "x");

}  // namespace mti
