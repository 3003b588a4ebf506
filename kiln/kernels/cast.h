// cast_value<D>(s): the element conversion every copy/cast/fill uses, on host and device (one
// definition for both backends). Integers and bool go through the accumulation type of the
// source; 16-bit floats through float; to bool means "!= 0".
#pragma once
#include <type_traits>

#include "kiln/core/dtype.h"
#include "kiln/core/macros.h"

namespace kiln::kernels {

template <class D, class S>
KILN_HD D cast_value(S s) {
  if constexpr (std::is_same_v<D, S>) return s;
  else if constexpr (std::is_same_v<D, bool>) return static_cast<acc_t<S>>(s) != acc_t<S>(0);
  else if constexpr (std::is_same_v<D, Half> || std::is_same_v<D, BFloat16>) return D(static_cast<float>(static_cast<acc_t<S>>(s)));
  else return static_cast<D>(static_cast<acc_t<S>>(s));
}

}  // namespace kiln::kernels
