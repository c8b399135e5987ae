/* A stand-in for the CUDA driver (libcuda.so.1) on a machine without a GPU, so that the
 * CUDA plugin's Mosaic GPU compiler (MosaicGpuCompile) runs its whole pipeline: MLIR passes,
 * LLVM's NVPTX back end and ptxas, for an H100 / H200 (compute capability 9.0, sm_90a).
 *
 * The plugin asks the current context's device for its compute capability, compiles, and
 * then loads the cubin. This driver answers the queries and refuses the load, after
 * counting it: a counted load means the cubin exists. benchmarks/gpu_compile.py builds it
 * (`cc -shared`) and loads it before the plugin looks for libcuda.so.1.
 */
#include <string.h>

typedef int CUresult;
enum { CUDA_SUCCESS = 0, CUDA_ERROR_NOT_SUPPORTED = 801 };
enum { ATTR_SM_COUNT = 16, ATTR_CC_MAJOR = 75, ATTR_CC_MINOR = 76, ATTR_SMEM_OPTIN = 97 };

static int context;       /* the address is the one context's handle */
static int images_loaded; /* cubins handed to cuModuleLoadData* */

int standin_images_loaded(void) { return images_loaded; }

CUresult cuInit(unsigned flags) { return CUDA_SUCCESS; }
CUresult cuDriverGetVersion(int *version) { *version = 13000; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int *count) { *count = 1; return CUDA_SUCCESS; }
CUresult cuDeviceGet(int *device, int ordinal) { *device = 0; return CUDA_SUCCESS; }
CUresult cuDeviceGetName(char *name, int len, int device) {
  strncpy(name, "stand-in sm_90a (no GPU)", len);
  return CUDA_SUCCESS;
}
CUresult cuDeviceGetAttribute(int *value, int attribute, int device) {
  switch (attribute) {
    case ATTR_CC_MAJOR: *value = 9; break;
    case ATTR_CC_MINOR: *value = 0; break;
    case ATTR_SM_COUNT: *value = 132; break;
    case ATTR_SMEM_OPTIN: *value = 227 * 1024; break;
    default: *value = 0;
  }
  return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(void **ctx) { *ctx = &context; return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(void *ctx) { return CUDA_SUCCESS; }
CUresult cuCtxGetDevice(int *device) { *device = 0; return CUDA_SUCCESS; }
CUresult cuCtxPushCurrent(void *ctx) { return CUDA_SUCCESS; }
CUresult cuCtxPopCurrent(void **ctx) { if (ctx) *ctx = &context; return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int device) { *ctx = &context; return CUDA_SUCCESS; }
CUresult cuModuleLoadData(void **module, const void *image) {
  images_loaded++;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuModuleLoadDataEx(void **module, const void *image, unsigned n, void *options, void **values) {
  return cuModuleLoadData(module, image);
}
CUresult cuGetErrorString(CUresult error, const char **text) {
  *text = "the stand-in driver loads no modules (there is no GPU)";
  return CUDA_SUCCESS;
}
CUresult cuGetErrorName(CUresult error, const char **text) {
  *text = "CUDA_ERROR_NOT_SUPPORTED";
  return CUDA_SUCCESS;
}
