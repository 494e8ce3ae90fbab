// Proves that NCCL links under --config=cuda: prints its version.
#include <nccl.h>

#include <cstdio>

int main() {
  int version = 0;
  ncclResult_t r = ncclGetVersion(&version);
  std::printf("nccl version %d (%s)\n", version, ncclGetErrorString(r));
  return r == ncclSuccess ? 0 : 1;
}
