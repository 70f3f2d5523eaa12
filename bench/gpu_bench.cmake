# gpu_bench: on a CUDA device, bf16 at::matmul TFLOP/s on one LLM layer's GEMMs (the baseline),
# causal GQA attention and one transformer layer forward+backward written with ATen ops (with its
# ratio to the matmul baseline), and device-to-device copy GB/s. JSON lines on stdout; without a
# CUDA device one "skipped" line and exit 0. Run by tools/gpu-check; see docs/gpu.md.
add_executable(gpu_bench "${CMAKE_CURRENT_LIST_DIR}/gpu_bench.cc")
hetpar_target_defaults(gpu_bench)
target_link_libraries(gpu_bench PRIVATE hetpar_nn ${TORCH_LIBRARIES} nlohmann_json::nlohmann_json
                      CLI11::CLI11)
if(HETPAR_TORCH_HAS_CUDA)
  # The device's name and size (at::cuda::getCurrentDeviceProperties): CUDA runtime headers, which
  # come with torch_cuda (CUDA::cudart).
  target_link_libraries(gpu_bench PRIVATE torch_cuda c10_cuda)
  target_compile_definitions(gpu_bench PRIVATE HETPAR_GPU_BENCH_HAS_CUDA_HEADERS=1)
endif()
