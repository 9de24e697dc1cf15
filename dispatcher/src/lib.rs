//! The elastic dispatcher: admits each job as a gang, places it whole on one pool, binds
//! its pods to that pool's virtual node, and reclaims by band with a checkpoint notice.
//!
//! Not built yet: this crate is the place for issue "dispatcher: gangs placed whole" and
//! issue "reclaim". Until then pods reach virtual nodes by `nodeName` and a toleration of
//! `tidepool.io/virtual`, which the vk-provider serves the same way.
