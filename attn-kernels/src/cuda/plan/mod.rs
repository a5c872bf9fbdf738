//! Planning, pure host code: the kernel variants (`choices`), the kernel names and
//! source text (`source`), which launches a config needs (`patterns`, re-exported here),
//! the parameter block a kernel reads (`params`), the fused and persistent forward's
//! pattern table (`fuse_table`), a block's launches as data (`launch_plan`), which the device and the emulation both execute, and
//! the sm_90a forward's TMA tensor maps (`tensor_maps`), and the run of a problem's heads a
//! block's tensors hold (`head_window`).

pub(crate) mod choices;
mod fuse_table;
pub mod head_window;
pub mod launch_plan;
pub mod params;
pub(crate) mod patterns;
pub mod source;
pub mod tensor_maps;

pub use patterns::*;
