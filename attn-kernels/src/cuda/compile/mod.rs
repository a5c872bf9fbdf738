//! Compiling the kernels: NVRTC (`nvrtc`, through the libnvrtc `nvrtc_library` finds with
//! `library_search`) turns a dtype's source into an image (`image`) for the device's
//! architecture, kept for the process (`slots`) and on disk (`kernel_cache`).

pub(crate) mod image;
pub mod kernel_cache;
pub(crate) mod library_search;
pub mod nvrtc;
pub(crate) mod nvrtc_library;
pub(crate) mod slots;
