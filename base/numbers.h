// Numbers as text: the shortest decimal that reads back as the same double,
// for hyperparameter files (trainer::HparamValue) and messages that quote a
// value (the examples' flag checks). Plain C++.
#ifndef SHARDTRAIN_BASE_NUMBERS_H_
#define SHARDTRAIN_BASE_NUMBERS_H_

#include <string>

namespace shardtrain {

// The shortest text that reads back as exactly `value` (1e-05, 0.1, 3,
// 0.00025): std::to_string's %f would print 1e-7 as 0.000000. NaN is "nan",
// infinities "inf" and "-inf".
std::string ShortestDecimal(double value);

}  // namespace shardtrain

#endif  // SHARDTRAIN_BASE_NUMBERS_H_
