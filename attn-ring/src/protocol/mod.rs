//! The protocol every call runs: the start-up handshake, the byte encoding of data
//! messages, the shared entry and exit of the public calls, and the two-round completion
//! step that gives every rank the same verdict before any output is written.

pub(crate) mod call;
pub(crate) mod completion;
pub(crate) mod handshake;
pub(crate) mod wire;
