//! meshpath's node agent as a library: the pinned datapath (`datapath`), network namespaces
//! (`netns`), and the pod lifecycle on top of them (`pods`). The `meshpath-loader` binary is a
//! thin CLI over this; the end-to-end tests drive the same functions.

pub mod agent;
pub mod datapath;
pub mod decisions;
pub mod doctor;
pub mod error;
pub mod monitor;
pub use meshpath_podnet::netns;
pub mod pods;
pub(crate) mod sys;

pub use error::{Error, Result};
