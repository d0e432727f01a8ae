// stofc ONNX Runtime custom-op library: the key-padding preparation kernel.
//
// Compiled to PTX with NVRTC when the library is built (stofc/package/ortlib.py)
// and embedded in libstofc_ort.so; the CUDA twin of SparseAttention launches it
// on ORT's stream before the attention kernel. It turns the model's
// key_padding_mask [B, S] into what the attention kernels take
// (stofc/runtime/attention.py):
//   kv_len[b]  = 1 + the last real key of sequence b (0 when none), or S when
//                there is no mask (kpm_type 0);
//   words[b * key_words + w] bit i = key w*64+i is real (little-endian bits,
//                zero past S); not written when kpm_type is 0.
// kpm_type: 0 none, 1 int64, 2 int32, 3 bool (one byte). One block per sequence.

extern "C" __global__ void stofc_key_prep(const void* __restrict__ kpm, int kpm_type, int B, int S,
                                          int key_words, int* __restrict__ kv_len,
                                          unsigned long long* __restrict__ words) {
    const int b = blockIdx.x;
    if (b >= B) return;
    __shared__ int last;
    if (threadIdx.x == 0) last = kpm_type == 0 ? S : 0;
    __syncthreads();
    if (kpm_type != 0) {
        for (int w = threadIdx.x; w < key_words; w += blockDim.x) {
            unsigned long long bits = 0ull;
            for (int i = 0; i < 64; ++i) {
                const int key = w * 64 + i;
                if (key >= S) break;
                const long long at = static_cast<long long>(b) * S + key;
                bool on;
                if (kpm_type == 1) on = static_cast<const long long*>(kpm)[at] != 0;
                else if (kpm_type == 2) on = static_cast<const int*>(kpm)[at] != 0;
                else on = static_cast<const unsigned char*>(kpm)[at] != 0;
                if (on) bits |= 1ull << i;
            }
            words[static_cast<long long>(b) * key_words + w] = bits;
            if (bits) atomicMax(&last, w * 64 + 64 - __clzll(static_cast<long long>(bits)));
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) kv_len[b] = last;
}
