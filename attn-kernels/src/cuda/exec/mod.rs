//! Executing plans: the device and its modules (`device`, `launch`), device tensors and
//! the memory of other libraries (`tensor`, `foreign`), the sm_90a forward's TMA tensor maps
//! (`tensor_map`), the f32 scratch pool
//! (`scratch`), the epilogues, ring blocks, whole calls and the `Attention` backend
//! (`epilogue`, `block`, `call`, `host`), GPU timing (`bench`) and the CPU emulation of
//! the kernels (`emulation`).

pub(crate) mod bench;
pub(crate) mod block;
pub(crate) mod call;
pub(crate) mod device;
pub mod emulation;
pub(crate) mod epilogue;
pub(crate) mod foreign;
pub(crate) mod host;
pub(crate) mod launch;
pub mod scratch;
pub(crate) mod tensor;
pub(crate) mod tensor_map;
