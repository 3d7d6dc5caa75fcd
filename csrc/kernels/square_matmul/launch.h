// What each kernel file of the family gives select.cu: the kernel's configuration for a call
// (from its tuning tables and the device's occupancy) and its launch. Each is instantiated
// in its kernel's file, for the types the kernel takes. The launches return the launch's
// error (cudaGetLastError() after it).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/square_matmul/args.cuh"
#include "kernels/square_matmul/select.h"

namespace mti::square_matmul {

// The staging kernels, mma.cu (MmaStaging: fp16/bf16) and fma.cu (FmaStaging: float, fp16,
// bf16; both in staging.cuh): the largest K (either transpose) whose rows of some tile fit in
// smem_optin bytes of shared memory; the index of the tile for a call (-1: none fits); the
// launch with that tile.
struct MmaStaging;
struct FmaStaging;
template <class Staging>
int64_t staging_max_k(size_t elem, int smem_optin);
template <class Staging, typename T>
int staging_tile(const Args<T>& a, bool trans, const DeviceInfo& d);
template <class Staging, typename T>
cudaError_t launch_staging(const Args<T>& a, bool trans, int tile, const DeviceInfo& d,
                           cudaStream_t stream);

// few_rows.cu (fp16/bf16; 1 to kFewRowsMax rows, K a multiple of 16, or of 32 transposed,
// 16-byte chunks of x and W, cooperative launches): the launches to try in order (warps 0:
// none), and one launch; cudaErrorCooperativeLaunchTooLarge where it is refused.
template <typename T>
void few_rows_configs(const Args<T>& a, bool trans, const DeviceInfo& d,
                      FewRowsConfig (&configs)[2]);
template <typename T>
cudaError_t launch_few_rows(const Args<T>& a, bool trans, const FewRowsConfig& c,
                            cudaStream_t stream);

// The streaming kernels, stream.cu (MmaStream) and wgmma_stream.cu (WgmmaStream; both in
// stream.cuh): fp16/bf16 on sm_90, 16-byte chunks of x and W; the warpgroup kernel also needs
// has_wgmma() and x's rows in one tensor map. The cheapest launch (cost INT64_MAX: none
// fits), and the launch.
struct MmaStream;
struct WgmmaStream;
template <class Streaming, typename T>
StreamConfig stream_config(const Args<T>& a, bool trans, const DeviceInfo& d);
template <class Streaming, typename T>
cudaError_t launch_stream(const Args<T>& a, bool trans, const StreamConfig& c, cudaStream_t stream);
// Whether the code loaded for the current device has the sm_90a (warpgroup MMA) kernels.
bool has_wgmma();

// handshake.cu (fp16/bf16 where the warpgroup kernels apply, cooperative launches): the
// launch (counters 0: it does not apply), and the launch, which zeroes the counters first
// unless counters_zero; cudaErrorCooperativeLaunchTooLarge where it is refused.
template <typename T>
HandshakeConfig handshake_config(const Args<T>& a, bool trans, const DeviceInfo& d);
template <typename T>
cudaError_t launch_handshake(const Args<T>& a, bool trans, const HandshakeConfig& c, int* counters,
                             bool counters_zero, cudaStream_t stream);

}  // namespace mti::square_matmul
