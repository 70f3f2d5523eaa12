# model_bench: forward+backward tokens/s of the encoder and the LLM at tp=1 and tp=2, with the
# achieved GFLOP/s as a ratio of at::matmul on the same shapes (JSON lines; see the source).
add_executable(model_bench ${CMAKE_CURRENT_LIST_DIR}/model_bench.cc)
hetpar_target_defaults(model_bench)
target_link_libraries(model_bench PRIVATE hetpar_encoder hetpar_llm)
