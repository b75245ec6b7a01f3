//go:build tools

// Package tools pins etcd for the test control plane. It is its own module
// because Kubernetes pulls a newer etcd client than the server wants.
package tools

import _ "go.etcd.io/etcd/server/v3"
