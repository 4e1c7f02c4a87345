// Probe: GPU and host cost per call of ways to hand a kernel a fresh 72-word
// context on the stream (what csrc/ctx_writer.h chose from). Standalone, no JAX:
//   nvcc -O2 -arch=sm_90 -o /tmp/prologue_probe tests/gpu/prologue_probe.cu -lcuda && /tmp/prologue_probe
// "gated=1" rows queue every call behind a spinning kernel first: GPU time per
// call with the host out of the way; "gated=0" rows are bound by the host.
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstring>
#include <vector>
#include <chrono>
#include <thread>
#include <algorithm>
#define CK(x) do { auto e_ = (x); if (e_ != 0) { printf("ERR %s line %d: %d\n", #x, __LINE__, (int)e_); exit(1);} } while (0)
constexpr int W = 72;
struct Ctx { long long w[W]; };
__device__ unsigned long long gt() { unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__global__ void consumer(const long long* ctx, long long* sink, unsigned long long* stamps, int i, int blocks_work) {
  if (threadIdx.x == 0 && blockIdx.x == 0) stamps[2 * i] = gt();
  long long s = 0;
  for (int k = threadIdx.x; k < W; k += blockDim.x) s += ctx[k];
  // a little work so the kernel is not empty
  for (int r = 0; r < blocks_work; ++r) s = s * 3 + r;
  if (s == 42) sink[blockIdx.x] = s;
  __syncthreads();
  if (threadIdx.x == 0 && blockIdx.x == 0) { stamps[2 * i + 1] = gt(); sink[0] += ctx[2]; }
}
__global__ void gate(volatile int* flag) { while (*flag == 0) {} }
__global__ void writer(Ctx c, long long* ctx) { int k = threadIdx.x; if (k < W) ctx[k] = c.w[k]; }
int main() {
  CK(cuInit(0)); cudaFree(0);
  CUdevice dev; CK(cuCtxGetDevice(&dev));
  int can = 0; cuDeviceGetAttribute(&can, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev);
  printf("64-bit stream mem ops: %d\n", can);
  long long *tmpl, *ctx, *sink; unsigned long long* stamps;
  const int N = 400;
  CK(cudaMalloc(&tmpl, W * 8)); CK(cudaMalloc(&ctx, W * 8)); CK(cudaMalloc(&sink, 1 << 20));
  CK(cudaMalloc(&stamps, 2 * N * 8));
  std::vector<long long> host(W); for (int k = 0; k < W; ++k) host[k] = k * 7;
  CK(cudaMemcpy(tmpl, host.data(), W * 8, cudaMemcpyHostToDevice));
  const int RING = 4096; long long* pinned; CK(cudaMallocHost(&pinned, RING * W * 8));
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  std::vector<CUstreamBatchMemOpParams> ops(W);
  const char* names[] = {"kernel only", "memcpy D2D + memsetD32 (now)", "memcpy D2D + writeValue32",
                         "batchMemOp 72 x write64", "H2D memcpy from pinned ring", "writer kernel (param)",
                         "memcpy D2D only", "writeValue32 only"};
  int* flag; CK(cudaHostAlloc(&flag, 4, cudaHostAllocMapped)); int* dflag; CK(cudaHostGetDevicePointer(&dflag, flag, 0));
  for (int gated : {0, 1}) for (int work : {0}) for (int rep = 0; rep < 2; ++rep) for (int m = 0; m < 8; ++m) {
    CK(cudaStreamSynchronize(st));
    *flag = gated ? 0 : 1;
    if (gated) gate<<<1, 1, 0, st>>>(dflag);
    CK(cudaEventRecord(a, st));
    auto h0 = std::chrono::steady_clock::now();
    std::thread opener([&] { std::this_thread::sleep_for(std::chrono::milliseconds(300)); *(volatile int*)flag = 1; });
    for (int i = 0; i < N; ++i) {
      long long epoch = i + 1;
      switch (m) {
        case 0: break;
        case 1: CK(cudaMemcpyAsync(ctx, tmpl, W * 8, cudaMemcpyDeviceToDevice, st));
                CK(cuMemsetD32Async((CUdeviceptr)(ctx + 2), (unsigned)epoch, 1, st)); break;
        case 2: CK(cudaMemcpyAsync(ctx, tmpl, W * 8, cudaMemcpyDeviceToDevice, st));
                CK(cuStreamWriteValue32(st, (CUdeviceptr)(ctx + 2), (cuuint32_t)epoch, 0)); break;
        case 3: for (int k = 0; k < W; ++k) { memset(&ops[k], 0, sizeof(ops[k]));
                  ops[k].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
                  ops[k].writeValue.address = (CUdeviceptr)(ctx + k);
                  ops[k].writeValue.value64 = k == 2 ? epoch : host[k];
                  ops[k].writeValue.flags = 0; }
                { static bool told = false; auto r = cuStreamBatchMemOp(st, W, ops.data(), 0); if (r && !told) { auto r1 = cuStreamBatchMemOp(st, 1, ops.data(), 0); printf("batch of %d: %d, of 1: %d\n", W, (int)r, (int)r1); told = true; } } break;
        case 4: { long long* slot = pinned + (i % RING) * W; memcpy(slot, host.data(), W * 8); slot[2] = epoch;
                  CK(cudaMemcpyAsync(ctx, slot, W * 8, cudaMemcpyHostToDevice, st)); break; }
        case 5: { Ctx c; memcpy(c.w, host.data(), W * 8); c.w[2] = epoch; writer<<<1, 96, 0, st>>>(c, ctx); break; }
        case 6: CK(cudaMemcpyAsync(ctx, tmpl, W * 8, cudaMemcpyDeviceToDevice, st)); break;
        case 7: CK(cuStreamWriteValue32(st, (CUdeviceptr)(ctx + 2), (cuuint32_t)epoch, 0)); break;
      }
      consumer<<<132, 128, 0, st>>>(ctx, sink, stamps, i, work);
    }
    CK(cudaEventRecord(b, st));
    double host_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count() / N;
    opener.join(); CK(cudaEventSynchronize(b));
    float ms; cudaEventElapsedTime(&ms, a, b);
    std::vector<unsigned long long> s(2 * N); CK(cudaMemcpy(s.data(), stamps, 2 * N * 8, cudaMemcpyDeviceToHost));
    std::vector<double> gap, dur;
    for (int i = 100; i < N; ++i) { gap.push_back((s[2 * i] - s[2 * i - 1]) / 1e3); dur.push_back((s[2 * i + 1] - s[2 * i]) / 1e3); }
    std::sort(gap.begin(), gap.end()); std::sort(dur.begin(), dur.end());
    // check the last ctx is right
    std::vector<long long> got(W); CK(cudaMemcpy(got.data(), ctx, W * 8, cudaMemcpyDeviceToHost));
    bool ok = m == 0 || m == 6 || got[2] == N || (m == 0);
    double period = (s[2 * N - 2] - s[200]) / 1e3 / (N - 1 - 100);
    printf("gated=%d rep=%d %-32s host enqueue %.2f us/call | GPU period %.2f us | gap (end stamp -> next start) median %.2f p90 %.2f | kernel body %.2f %s\n",
           gated, rep, names[m], host_us, period, gap[gap.size() / 2], gap[gap.size() * 9 / 10], dur[dur.size() / 2], ok ? "" : "CTX WRONG");
  }
  return 0;
}
