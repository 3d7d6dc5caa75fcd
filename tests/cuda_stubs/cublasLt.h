// Stand-in (see README.md): the types ATen's CUDA headers name.
#pragma once
typedef struct cublasLtContext* cublasLtHandle_t;
