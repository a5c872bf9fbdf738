//! The integration tests of this crate in one binary (one link and one set of generic
//! instances for all of them); each module is one test file.

mod block_mask_reference;
mod golden_reference;
mod hand_built_shapes;
mod reference_properties;
mod supported_set;
