#include "core/cuda_graph.h"

#include "core/check.h"
#ifdef MT_WITH_CUDA
#include "core/cuda_check.h"
#endif

namespace mt {

struct CudaGraph::Impl {
#ifdef MT_WITH_CUDA
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  void reset() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    exec = nullptr;
    graph = nullptr;
  }
  ~Impl() { reset(); }
#endif
};

CudaGraph::CudaGraph() : impl_(std::make_unique<Impl>()) {}
CudaGraph::~CudaGraph() = default;
CudaGraph::CudaGraph(CudaGraph&&) noexcept = default;
CudaGraph& CudaGraph::operator=(CudaGraph&&) noexcept = default;

void CudaGraph::capture(const Stream& stream, const std::function<void()>& body) {
#ifdef MT_WITH_CUDA
  MT_REQUIRE(stream.device().is_cuda(), "CUDA graphs need a CUDA device; the stream is on {}", stream.device().str());
  impl_->reset();
  const auto s = static_cast<cudaStream_t>(stream.cuda_stream());
  MT_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  cudaGraph_t g = nullptr;
  try {
    body();
  } catch (...) {
    cudaStreamEndCapture(s, &g);  // leave capture mode; the partial graph is discarded
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
    throw;
  }
  const cudaError_t end = cudaStreamEndCapture(s, &g);
  if (end != cudaSuccess) {
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
    MT_FAIL("CUDA graph capture failed: {} ({}); the captured region synchronised with the host, allocated "
            "device memory or used a stream it did not join (docs/cuda_graphs.md, capture rules)",
            cudaGetErrorName(end), cudaGetErrorString(end));
  }
  impl_->graph = g;
  MT_CUDA_CHECK(cudaGraphInstantiateWithFlags(&impl_->exec, g, 0));
#else
  (void)stream;
  (void)body;
  MT_FAIL("CUDA graphs need the CUDA build of megatron.cpp; this binary was built without CUDA");
#endif
}

void CudaGraph::launch(const Stream& stream) const {
  MT_REQUIRE(captured(), "CUDA graph launched before it was captured");
#ifdef MT_WITH_CUDA
  MT_CUDA_CHECK(cudaGraphLaunch(impl_->exec, static_cast<cudaStream_t>(stream.cuda_stream())));
#else
  (void)stream;
#endif
}

bool CudaGraph::captured() const {
#ifdef MT_WITH_CUDA
  return impl_ && impl_->exec != nullptr;
#else
  return false;
#endif
}

size_t CudaGraph::num_nodes() const {
#ifdef MT_WITH_CUDA
  if (!impl_ || !impl_->graph) return 0;
  size_t n = 0;
  MT_CUDA_CHECK(cudaGraphGetNodes(impl_->graph, nullptr, &n));
  return n;
#else
  return 0;
#endif
}

}  // namespace mt
