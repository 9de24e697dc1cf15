//! End-to-end tests: the real `tidepool` binary against real local clusters (a training
//! cluster and two members, each with kube-apiserver, controller-manager and scheduler,
//! kwok simulating member nodes). See `harness.rs` for how the clusters are found.

// Test code: a failed expectation is a panic with a message, by design.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod bad_input;
mod chart;
mod colocation;
mod credentials;
mod deletion;
mod deploy;
mod dispatcher;
mod disruptions;
mod drain;
mod elastic;
mod eviction_requests;
mod failover;
mod gang_scheduler;
mod harness;
mod kubelet_api;
mod kueue;
mod member_disruption;
mod member_status;
mod membership;
mod metrics;
mod mpijob;
mod native_floor;
mod node_status;
mod operations;
mod operators;
mod paddlejob;
mod plugin;
mod pytorchjob;
mod real_nodes;
mod reclaim;
mod refusals;
mod restart;
mod services;
mod sharding;
mod skeleton;
mod tfjob;
mod throttle;
mod topology;
mod training;
mod trainjob;
mod validation;
mod version_skew;
mod vk_features;
mod volcano;
