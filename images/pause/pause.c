/*
 * The pod sandbox's init process (what the kubelet's sandbox image `registry.k8s.io/pause`
 * runs): it holds the pod's namespaces open, exits cleanly when asked, and reaps zombies
 * when the pod shares its PID namespace. Built `gcc -Os -static` by e2e/harness/images/, so the
 * image needs nothing but this binary (FROM scratch).
 */
#include <signal.h>
#include <stddef.h>
#include <stdlib.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int signo) {
    (void)signo;
    _exit(0);
}

static void on_child(int signo) {
    (void)signo;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction stop = {0};
    struct sigaction child = {0};
    stop.sa_handler = on_stop;
    child.sa_handler = on_child;
    child.sa_flags = SA_NOCLDSTOP | SA_RESTART;
    if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0 ||
        sigaction(SIGCHLD, &child, NULL) < 0) {
        return 1;
    }
    for (;;) {
        pause();
    }
    return 0;
}
