// The gated activations of the expert MLPs, in fp32 (moe/act.cu and moe/decode.cu's gate_up epilogue):
//   ACT 0 "silu":        silu(gate) * up                                          (Mixtral, Qwen-MoE)
//   ACT 1 "swiglu_oai":  g = min(gate, 7), u = clamp(up, -7, 7); (u + 1) * g * sigmoid(1.702 g)   (gpt-oss)
// The clamps are compares, not fminf, so a NaN stays a NaN as in torch.clamp.
#pragma once

namespace tf {

constexpr float kSwigluAlpha = 1.702f;
constexpr float kSwigluLimit = 7.f;

template <int ACT>
__device__ __forceinline__ float gated(float gate, float up) {
    if constexpr (ACT == 0) {
        return gate / (1.f + __expf(-gate)) * up;
    } else {
        const float g = gate > kSwigluLimit ? kSwigluLimit : gate;
        const float u = up > kSwigluLimit ? kSwigluLimit : (up < -kSwigluLimit ? -kSwigluLimit : up);
        return (u + 1.f) * g / (1.f + __expf(-kSwigluAlpha * g));
    }
}

}  // namespace tf
