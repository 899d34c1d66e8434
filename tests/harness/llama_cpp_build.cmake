# Read by llama.cpp's own project() when `make test` builds llama-cpp-python (the Makefile
# passes it as CMAKE_PROJECT_llama.cpp_INCLUDE_BEFORE). llama-cpp-python forces llama.cpp's
# "common" library on, which its Python bindings never load and which is two fifths of the
# build's CPU (its sources include the JSON library everywhere); llama.cpp reads the option
# after this file, so it stays off.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama-cpp-python loads only libllama and ggml" FORCE)
