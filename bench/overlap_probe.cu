// Probe (not built by CMake): can a bandwidth-bound AdamW-like update run beside compute-bound
// cuBLASLt GEMMs on another stream, and at what cost to each? Shapes of the Llama-style 1.18B
// model's forward (tokens 4096, hidden 2048, fc1 gate+up 16384): the GEMM row-major
// y[4096, 16384] = x[4096, 2048] · w[16384, 2048]^T, bf16, 12 launches; the update reads fp32
// g, p, m, v and writes p, m, v and a bf16 copy (30 bytes per element) over n elements.
// Variants: each alone; both at once (the update on a lower-priority stream); the GEMM limited
// to (SMs - k) by CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET with the update's grid on k SMs.
// Green contexts (CUDA 12.4+ driver API): the GEMM stream on (SMs - k) SMs and the update stream
// on k SMs, a hard partition instead of the block scheduler's sharing.
// Build and run on a GPU machine: nvcc -O3 -arch=sm_90 bench/overlap_probe.cu -lcublasLt -lcuda && ./a.out
#include <cublasLt.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>

__global__ void update(const float4* __restrict__ g, float4* __restrict__ p, float4* __restrict__ m,
                       float4* __restrict__ v, __nv_bfloat162* __restrict__ model, int64_t n4) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n4; i += (int64_t)gridDim.x * blockDim.x) {
    float4 gg = g[i], pp = p[i], mm = m[i], vv = v[i];
    float* gs = &gg.x; float* ps = &pp.x; float* ms = &mm.x; float* vs = &vv.x;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      ms[j] = 0.9f * ms[j] + 0.1f * gs[j];
      vs[j] = 0.999f * vs[j] + 0.001f * gs[j] * gs[j];
      ps[j] -= 1e-4f * (ms[j] / (sqrtf(vs[j]) + 1e-8f) + 0.1f * ps[j]);
    }
    p[i] = pp; m[i] = mm; v[i] = vv;
    model[2 * i] = __floats2bfloat162_rn(pp.x, pp.y);
    model[2 * i + 1] = __floats2bfloat162_rn(pp.z, pp.w);
  }
}

int main() {
  int sms = 0; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cublasLtHandle_t lt; cublasLtCreate(&lt);
  const int64_t M = 4096, N = 16384, K = 2048;  // row-major y[M, N] = x[M, K] w[N, K]^T
  void *x, *w, *y, *ws; cudaMalloc(&x, M*K*2); cudaMalloc(&w, N*K*2); cudaMalloc(&y, M*N*2); cudaMalloc(&ws, 32<<20);
  cudaMemset(x, 0, M*K*2); cudaMemset(w, 0, N*K*2);
  const int64_t n = 256ll << 20;  // elements of the update: 8 GB of traffic
  float *g, *p, *m, *v; __nv_bfloat162* model;
  cudaMalloc(&g, n*4); cudaMalloc(&p, n*4); cudaMalloc(&m, n*4); cudaMalloc(&v, n*4); cudaMalloc(&model, n*2);
  cudaMemset(g, 0, n*4); cudaMemset(p, 0, n*4); cudaMemset(m, 0, n*4); cudaMemset(v, 0, n*4);
  int lo, hi; cudaDeviceGetStreamPriorityRange(&lo, &hi);
  cudaStream_t sg, su; cudaStreamCreateWithPriority(&sg, cudaStreamNonBlocking, hi); cudaStreamCreateWithPriority(&su, cudaStreamNonBlocking, lo);
  int occ = 0; cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, update, 256, 0);
  cudaFuncAttributes fa; cudaFuncGetAttributes(&fa, update);
  printf("SMs %d, update: %d regs, %d blocks of 256 per SM\n", sms, fa.numRegs, occ);

  auto make_gemm = [&](int sm_target, cublasLtMatmulDesc_t* op, cublasLtMatrixLayout_t* la, cublasLtMatrixLayout_t* lb,
                       cublasLtMatrixLayout_t* lc, cublasLtMatmulAlgo_t* algo) {
    cublasLtMatmulDescCreate(op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    int32_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;  // column-major: y'[N, M] = w'^T... = (w[N,K])·x'
    cublasLtMatmulDescSetAttribute(*op, CUBLASLT_MATMUL_DESC_TRANSA, &t, 4);
    cublasLtMatmulDescSetAttribute(*op, CUBLASLT_MATMUL_DESC_TRANSB, &nn, 4);
    if (sm_target > 0) cublasLtMatmulDescSetAttribute(*op, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sm_target, 4);
    cublasLtMatrixLayoutCreate(la, CUDA_R_16BF, K, N, K); cublasLtMatrixLayoutCreate(lb, CUDA_R_16BF, K, M, K);
    cublasLtMatrixLayoutCreate(lc, CUDA_R_16BF, N, M, N);
    cublasLtMatmulPreference_t pref; cublasLtMatmulPreferenceCreate(&pref);
    uint64_t wsb = 32<<20; cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, 8);
    cublasLtMatmulHeuristicResult_t res[1]; int got = 0;
    cublasLtMatmulAlgoGetHeuristic(lt, *op, *la, *lb, *lc, *lc, pref, 1, res, &got);
    *algo = res[0].algo;
    return got;
  };
  const int reps = 12;
  cudaEvent_t e0, e1, e2, e3; cudaEventCreate(&e0); cudaEventCreate(&e1); cudaEventCreate(&e2); cudaEventCreate(&e3);
  CUdevice dev; cuDeviceGet(&dev, 0);
  CUdevResource all; cuDeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM);
  for (int green : {0, 1, 2})  // 1: green contexts, 2: and the GEMM's SM count target
  for (int k : {0, 8, 16, 24, 32, 48}) {  // k = SMs left to the update (0: no limit on either)
    if (green && k == 0) continue;
    cudaStream_t sg0 = sg, su0 = su;
    if (green) {
      CUdevResource part[1], rest; unsigned nb = 1;
      CUresult r = cuDevSmResourceSplitByCount(part, &nb, &all, &rest, 0, k);
      CUdevResourceDesc dp, dr; CUgreenCtx gp, gr; CUstream spart, srest;
      if (r == CUDA_SUCCESS) r = cuDevResourceGenerateDesc(&dp, part, 1);
      if (r == CUDA_SUCCESS) r = cuDevResourceGenerateDesc(&dr, &rest, 1);
      if (r == CUDA_SUCCESS) r = cuGreenCtxCreate(&gp, dp, dev, CU_GREEN_CTX_DEFAULT_STREAM);
      if (r == CUDA_SUCCESS) r = cuGreenCtxCreate(&gr, dr, dev, CU_GREEN_CTX_DEFAULT_STREAM);
      if (r == CUDA_SUCCESS) r = cuGreenCtxStreamCreate(&spart, gp, CU_STREAM_NON_BLOCKING, 0);
      if (r == CUDA_SUCCESS) r = cuGreenCtxStreamCreate(&srest, gr, CU_STREAM_NON_BLOCKING, 0);
      if (r != CUDA_SUCCESS) { printf("green k %d: error %d\n", k, (int)r); continue; }
      printf("green: update partition %u SMs, GEMM partition %u SMs\n", part[0].sm.smCount, rest.sm.smCount);
      sg = (cudaStream_t)srest; su = (cudaStream_t)spart;
    }
    cublasLtMatmulDesc_t op; cublasLtMatrixLayout_t la, lb, lc; cublasLtMatmulAlgo_t algo;
    if (!make_gemm(k && green != 1 ? sms - k : 0, &op, &la, &lb, &lc, &algo)) { printf("k %d: no algorithm\n", k); continue; }
    float alpha = 1, beta = 0;
    auto gemms = [&]() { for (int i = 0; i < reps; ++i) cublasLtMatmul(lt, op, &alpha, w, la, x, lb, &beta, y, lc, y, lc, &algo, ws, 32<<20, sg); };
    const int grid = (k ? k : sms) * occ;
    auto upd = [&]() { update<<<grid, 256, 0, su>>>((const float4*)g, (float4*)p, (float4*)m, (float4*)v, model, n / 4); };
    float tg = 0, tu = 0, tb = 0, tbg = 0;
    for (int it = 0; it < 3; ++it) {
      cudaEventRecord(e0, sg); gemms(); cudaEventRecord(e1, sg); cudaEventSynchronize(e1); cudaEventElapsedTime(&tg, e0, e1);
      cudaEventRecord(e0, su); upd(); cudaEventRecord(e1, su); cudaEventSynchronize(e1); cudaEventElapsedTime(&tu, e0, e1);
      cudaDeviceSynchronize();
      cudaEventRecord(e0, sg); cudaStreamWaitEvent(su, e0, 0); upd(); gemms(); cudaEventRecord(e2, sg); cudaEventRecord(e3, su);
      cudaStreamWaitEvent(sg, e3, 0); cudaEventRecord(e1, sg); cudaEventSynchronize(e1);
      cudaEventElapsedTime(&tb, e0, e1); cudaEventElapsedTime(&tbg, e0, e2);
    }
    const double tflop = 2.0 * M * N * K * reps / 1e12;
    printf("%s k %2d: gemms alone %.2f ms (%.0f TFLOP/s), update alone %.2f ms (%.2f TB/s), both %.2f ms (gemms done at %.2f), "
           "sum %.2f, hidden %.2f ms\n", green == 2 ? "green+target" : green ? "green" : "plain", k, tg, tflop / tg * 1e3, tu, 30.0 * n / tu / 1e9, tb, tbg, tg + tu, tg + tu - tb);
    sg = sg0; su = su0;
  }
  printf("err %s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
