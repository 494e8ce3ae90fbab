#include <cuda_runtime.h>

#include "third_party/smoke/cuda_smoke.h"

__global__ void AddOneKernel(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += 1.0f;
}

int CudaSmokeAddOne(float* host_values, int n) {
  float* dev = nullptr;
  cudaError_t err = cudaMalloc(&dev, sizeof(float) * n);
  if (err != cudaSuccess) return err;
  cudaMemcpy(dev, host_values, sizeof(float) * n, cudaMemcpyHostToDevice);
  AddOneKernel<<<(n + 255) / 256, 256>>>(dev, n);
  err = cudaMemcpy(host_values, dev, sizeof(float) * n, cudaMemcpyDeviceToHost);
  cudaFree(dev);
  return err;
}
