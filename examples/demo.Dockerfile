# The quickstart's env as a Dockerfile: `fanfold build examples/demo.Dockerfile` (the context is this directory).
FROM host
ENV PYTHONDONTWRITEBYTECODE=1
WORKDIR /env
COPY demo_project .
RUN python3 -m compileall -q /env
CMD ["python3", "-m", "unittest", "-q"]
