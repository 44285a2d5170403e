// Probe (not built by CMake): which cuBLASLt GELU-backward epilogues exist for GPT-2's fc2 dgrad
// (row-major dpre[16384, 3072] = dy[16384, 768] · w[768, 3072], bf16) and what each costs.
// Measured on an H100 (2026-11-24): DGELU 0.147 ms (the same as the plain GEMM); DGELU_BGRAD
// 0.468 ms; either with an fp32 bias-gradient type: no algorithm. ops/cuda/matmul.cu therefore
// uses DGELU and sums fc1's bias gradient with its own column-sum kernel.
// Build and run on a GPU machine: nvcc -O2 -arch=sm_90 bench/gemm_epilogue_probe.cu -lcublasLt && ./a.out
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
int main() {
  cublasLtHandle_t lt; cublasLtCreate(&lt);
  // row-major dpre[m, k] = dy[m, n] w[n, k]; column-major: D'[k, m] = w'[k, n] dy'[n, m], all N
  const int64_t m = 16384, k = 3072, n = 768;
  void *A, *B, *D, *aux, *bias; cudaMalloc(&A, k*n*2); cudaMalloc(&B, n*m*2); cudaMalloc(&D, k*m*2); cudaMalloc(&aux, k*m*2); cudaMalloc(&bias, k*4);
  void* ws; cudaMalloc(&ws, 32<<20);
  for (int epi : {CUBLASLT_EPILOGUE_DGELU, CUBLASLT_EPILOGUE_DGELU_BGRAD}) for (int bt : {-1, (int)CUDA_R_32F, (int)CUDA_R_16BF}) for (int red : {0, 1}) {
    cublasLtMatmulDesc_t op; cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    int32_t t = CUBLAS_OP_N; cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, 4); cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &t, 4);
    uint32_t e = epi; cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, 4);
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, 8);
    int64_t ld = k; cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, 8);
    if (epi == CUBLASLT_EPILOGUE_DGELU_BGRAD) cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, 8);
    if (bt >= 0) { int32_t b = bt; cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &b, 4); }
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, n, k); cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, n, m, n); cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, k, m, k);
    cublasLtMatmulPreference_t pref; cublasLtMatmulPreferenceCreate(&pref);
    uint64_t wsb = 32<<20; cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, 8);
    if (red) { uint32_t mask = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE; cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, 4); }
    cublasLtMatmulHeuristicResult_t res[4]; int got = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 4, res, &got);
    float ms = -1;
    if (st == CUBLAS_STATUS_SUCCESS && got > 0) {
      float alpha = 1, beta = 0; cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
      for (int i = 0; i < 3; ++i) cublasLtMatmul(lt, op, &alpha, A, la, B, lb, &beta, D, lc, D, lc, &res[0].algo, ws, wsb, 0);
      cudaEventRecord(a); for (int i = 0; i < 20; ++i) cublasLtMatmul(lt, op, &alpha, A, la, B, lb, &beta, D, lc, D, lc, &res[0].algo, ws, wsb, 0);
      cudaEventRecord(b); cudaEventSynchronize(b); cudaEventElapsedTime(&ms, a, b); ms /= 20;
    }
    printf("epi %s bias_type %d reduction_mask %d: status %d, %d algos, %.3f ms, err %s\n", epi == CUBLASLT_EPILOGUE_DGELU ? "DGELU" : "DGELU_BGRAD", bt, red, (int)st, got, ms, cudaGetErrorString(cudaGetLastError()));
  }
  return 0;
}
