#ifndef GRADSUM_THIRD_PARTY_SMOKE_CUDA_SMOKE_H_
#define GRADSUM_THIRD_PARTY_SMOKE_CUDA_SMOKE_H_

// Adds 1.0f to n floats on the device; returns the cudaError_t as an int.
int CudaSmokeAddOne(float* host_values, int n);

#endif  // GRADSUM_THIRD_PARTY_SMOKE_CUDA_SMOKE_H_
