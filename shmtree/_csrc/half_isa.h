/*
 * The eight 16-bit kernels (float16 and bfloat16 x sum, prod, min, max) for one instruction set:
 * no include guard on purpose.  The includer (half_kernels.h) defines SHMT_ISA (the suffix of
 * the kernels' names) and SHMT_ATTR; this file #undefs both at the end.
 */

#define SHMT_FIRST shmt_half_first
#define SHMT_SECOND shmt_half_second
#define SHMT_TO_FLOAT shmt_half_to_float
#define SHMT_FROM_FLOAT shmt_float_to_half

#define SHMT_NAME SHMT_CAT(shmt_f16_sum_, SHMT_ISA)
#define SHMT_OP shmt_op_sum
#define SHMT_PACK shmt_half_pair
#include "half_loops.h"

#define SHMT_NAME SHMT_CAT(shmt_f16_prod_, SHMT_ISA)
#define SHMT_OP shmt_op_prod
#define SHMT_PACK shmt_half_pair
#include "half_loops.h"

#define SHMT_NAME SHMT_CAT(shmt_f16_min_, SHMT_ISA)
#define SHMT_OP shmt_op_min
#define SHMT_PACK shmt_half_pair
#include "half_loops.h"

#define SHMT_NAME SHMT_CAT(shmt_f16_max_, SHMT_ISA)
#define SHMT_OP shmt_op_max
#define SHMT_PACK shmt_half_pair
#include "half_loops.h"

#undef SHMT_FIRST
#undef SHMT_SECOND
#undef SHMT_TO_FLOAT
#undef SHMT_FROM_FLOAT

#define SHMT_FIRST shmt_bf16_first
#define SHMT_SECOND shmt_bf16_second
#define SHMT_TO_FLOAT shmt_bf16_to_float
#define SHMT_FROM_FLOAT shmt_float_to_bf16

/* Sums and products round without the NaN select (shmt_float_to_bf16_32_arith); min and max
 * pass signaling NaNs through and need it. */
#define SHMT_NAME SHMT_CAT(shmt_bf16_sum_, SHMT_ISA)
#define SHMT_OP shmt_op_sum
#define SHMT_PACK shmt_bf16_pair_arith
#include "half_loops.h"

#define SHMT_NAME SHMT_CAT(shmt_bf16_prod_, SHMT_ISA)
#define SHMT_OP shmt_op_prod
#define SHMT_PACK shmt_bf16_pair_arith
#include "half_loops.h"

#define SHMT_NAME SHMT_CAT(shmt_bf16_min_, SHMT_ISA)
#define SHMT_OP shmt_op_min
#define SHMT_PACK shmt_bf16_pair
#include "half_loops.h"

#define SHMT_NAME SHMT_CAT(shmt_bf16_max_, SHMT_ISA)
#define SHMT_OP shmt_op_max
#define SHMT_PACK shmt_bf16_pair
#include "half_loops.h"

#undef SHMT_FIRST
#undef SHMT_SECOND
#undef SHMT_TO_FLOAT
#undef SHMT_FROM_FLOAT
#undef SHMT_ISA
#undef SHMT_ATTR
