# Included before find_package(Torch) by the build of the component `torch` and by the installed
# config when a project asks for it.
#
# A CUDA build of libtorch (PyPI's default wheel) makes find_package(Torch) look for nvcc and the
# CUDA toolkit, and fail without them, though nothing built against SuperOffload::torch compiles
# CUDA code: libtorch_cuda links the CUDA runtime itself. Torch's config skips that search when
# the target torch::cudart exists, so where no CUDA compiler is found (or SO_TORCH_CUDA_STANDIN
# is ON, e.g. where the toolkit found does not suit torch's config), define it, empty.
if(NOT TARGET torch::cudart)
  set(_so_cudart_standin "${SO_TORCH_CUDA_STANDIN}")
  if(NOT _so_cudart_standin AND NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
    find_program(SO_NVCC nvcc HINTS "$ENV{CUDA_HOME}/bin" /usr/local/cuda/bin)
    if(NOT SO_NVCC)
      set(_so_cudart_standin ON)
    endif()
  endif()
  if(_so_cudart_standin)
    add_library(torch::cudart INTERFACE IMPORTED)
  endif()
endif()
