// Metal-compatibility prelude for the lily_mlx CPU simulator (C++20). Included before the
// translated kernel text; see docs/simulator.md for what is modelled.
#pragma once
#include "metal_types.h"
#include "metal_math.h"
#include "runtime.h"
#include "simd.h"
#include "simdgroup_matrix.h"
#include "launch.h"
