#ifndef GRADSUM_TESTING_STATUS_TESTING_H_
#define GRADSUM_TESTING_STATUS_TESTING_H_

// gtest assertions on absl::Status that print the status when they fail.
//
//   GRADSUM_EXPECT_OK(comm.Barrier());
//   GRADSUM_ASSERT_OK(bucketer.Finalize());

#include "absl/status/status.h"
#include "gtest/gtest.h"

#define GRADSUM_EXPECT_OK(expr)                                         \
  do {                                                                  \
    const ::absl::Status gradsum_expect_status_ = (expr);               \
    EXPECT_TRUE(gradsum_expect_status_.ok()) << gradsum_expect_status_; \
  } while (0)

#define GRADSUM_ASSERT_OK(expr)                                         \
  do {                                                                  \
    const ::absl::Status gradsum_assert_status_ = (expr);               \
    ASSERT_TRUE(gradsum_assert_status_.ok()) << gradsum_assert_status_; \
  } while (0)

#endif  // GRADSUM_TESTING_STATUS_TESTING_H_
