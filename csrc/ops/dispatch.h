// dtype dispatch for the four floating types the ops accept. The macro binds `scalar_t`;
// nest it by renaming first (`using x_t = scalar_t;`) before dispatching on a second dtype.
#pragma once

#include <torch/headeronly/core/Dispatch.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Exception.h>
#include <torch/headeronly/util/Half.h>

#define ROPE_DISPATCH_FLOATING(TYPE, NAME, ...)                                   \
  THO_DISPATCH_SWITCH(                                                            \
      TYPE, NAME,                                                                 \
      THO_DISPATCH_CASE(torch::headeronly::ScalarType::Float, __VA_ARGS__)        \
      THO_DISPATCH_CASE(torch::headeronly::ScalarType::Double, __VA_ARGS__)       \
      THO_DISPATCH_CASE(torch::headeronly::ScalarType::Half, __VA_ARGS__)         \
      THO_DISPATCH_CASE(torch::headeronly::ScalarType::BFloat16, __VA_ARGS__))
