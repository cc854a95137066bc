# The CUDA architectures to build machine code for (docs/build.md, "GPU architectures").
#
# jax_ep_cuda_architectures(CHOICE OUT) sets OUT to a CMake architecture list from CHOICE:
# - "auto": $JAX_EP_CUDA_ARCHITECTURES when set, else this machine's GPUs (nvidia-smi's compute
#   capabilities, one build each), else "all";
# - "all": ALL, every architecture a wheel carries (pyproject.toml's
#   JAX_EP_ALL_CUDA_ARCHITECTURES);
# - anything else: a list as CMake writes it ("90-real", "80-real;90-real").
# Never "native": without a GPU (CI) it fails, and this picks "all" there instead.
function(jax_ep_cuda_architectures choice all out)
  if(choice STREQUAL "auto" AND NOT "$ENV{JAX_EP_CUDA_ARCHITECTURES}" STREQUAL "")
    set(choice "$ENV{JAX_EP_CUDA_ARCHITECTURES}")
  endif()
  if(choice STREQUAL "auto")
    set(choice "all")
    find_program(_jax_ep_nvidia_smi nvidia-smi NO_CACHE)
    if(_jax_ep_nvidia_smi)
      execute_process(COMMAND "${_jax_ep_nvidia_smi}" --query-gpu=compute_cap
                              --format=csv,noheader
                      OUTPUT_VARIABLE caps RESULT_VARIABLE failed ERROR_QUIET TIMEOUT 30)
      set(found "")
      if(NOT failed)
        string(REPLACE "\n" ";" caps "${caps}")
        foreach(cap IN LISTS caps)
          string(STRIP "${cap}" cap)
          if(cap MATCHES "^([0-9]+)\\.([0-9]+)$")
            list(APPEND found "${CMAKE_MATCH_1}${CMAKE_MATCH_2}-real")
          endif()
        endforeach()
      endif()
      if(found)
        list(REMOVE_DUPLICATES found)
        set(choice "${found}")
      endif()
    endif()
  endif()
  if(choice STREQUAL "all")
    set(choice "${all}")
  endif()
  set(${out} "${choice}" PARENT_SCOPE)
endfunction()
