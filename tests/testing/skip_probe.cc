// A test that always lacks what it needs: skip_rule_test runs it with and
// without CI=true to show that ST_SKIP_UNLESS_CI skips on a developer's
// machine and fails under CI.
#include <gtest/gtest.h>

#include "tests/testing/skip.h"

TEST(SkipProbe, LacksATool) { ST_SKIP_UNLESS_CI() << "the probe's tool is missing"; }
