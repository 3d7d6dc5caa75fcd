// Stand-in (see README.md): the types ATen's CUDA headers name.
#pragma once
typedef struct cusparseContext* cusparseHandle_t;
typedef int cusparseStatus_t;
