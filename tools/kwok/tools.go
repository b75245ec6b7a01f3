//go:build tools

// Package tools pins the KWOK controller that simulates the test nodes.
package tools

import _ "sigs.k8s.io/kwok/cmd/kwok"
