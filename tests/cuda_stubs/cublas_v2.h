// Stand-in (see README.md): the types ATen's CUDA headers name.
#pragma once
typedef struct cublasContext* cublasHandle_t;
typedef int cublasStatus_t;
