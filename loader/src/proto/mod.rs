//! Generated gRPC types of `decode.proto` (built by build.rs with protox, no protoc needed).

#![allow(clippy::all, clippy::pedantic, missing_docs)]

tonic::include_proto!("stoker.decode.v1");
