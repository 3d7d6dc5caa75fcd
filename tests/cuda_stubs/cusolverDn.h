// Stand-in (see README.md): the types ATen's CUDA headers name.
#pragma once
#include "cusolver_common.h"
typedef struct cusolverDnContext* cusolverDnHandle_t;
