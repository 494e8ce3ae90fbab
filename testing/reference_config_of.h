#ifndef GRADSUM_TESTING_REFERENCE_CONFIG_OF_H_
#define GRADSUM_TESTING_REFERENCE_CONFIG_OF_H_

// The model the library builds (model/moe_lm_spec.h MoeLmConfig), in the fp64 reference's
// terms (testing/reference_moe_lm.h ReferenceConfig): the one place the two are matched
// field by field, beside the reference, so the reference itself depends on no model code
// and a caller (the parity check, tests) writes no copy of its own. What the model config
// does not hold (the expert bias, the CE weighting mode) the caller sets.

#include "model/moe_lm_spec.h"
#include "testing/reference_moe_lm.h"

namespace gradsum::testing {

ReferenceConfig ReferenceConfigOf(const model::MoeLmConfig& m);

}  // namespace gradsum::testing

#endif  // GRADSUM_TESTING_REFERENCE_CONFIG_OF_H_
