// Stand-in (see README.md): the types ATen's CUDA headers name.
#pragma once
typedef int cusolverStatus_t;
